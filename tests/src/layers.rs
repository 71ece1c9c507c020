//! Module cycles inside a crate, found from its `use` edges and paths.
//!
//! cargo-modules answers the same question but takes minutes to build;
//! this reads the sources as tokens, which is enough for the paths dmkv
//! writes: `use` trees (with braces, globs and aliases), `crate::`,
//! `super::` and `self::` paths in code, and a child module named in its
//! parent's code. A name re-exported by `pub use` is followed to the
//! module that defines it, so a facade's re-exports do not count as a
//! cycle of their own. Comments and literals are skipped, so doc links do
//! not make edges.
//!
//! A node of the graph is one source file; an inline module belongs to
//! its file. An edge A → B means A names something that B defines. A
//! cycle is a strongly connected component with more than one file.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// How many re-exports a path is followed through before giving up
/// (a loop of `pub use` would otherwise not end).
const MAX_REEXPORT_HOPS: usize = 16;

/// One module file of a crate.
#[derive(Debug, Default)]
struct Module {
    file: PathBuf,
    /// Absolute module path, `[]` for the crate root.
    path: Vec<String>,
    /// Names of the modules declared in it (`mod x;` or inline).
    children: BTreeSet<String>,
    /// `pub use` names: the visible name → absolute path it stands for.
    reexports: HashMap<String, Vec<String>>,
    /// Absolute paths it names.
    uses: Vec<Vec<String>>,
}

/// The module graph of one crate root (`src/lib.rs`, `src/main.rs`, ...).
#[derive(Debug)]
pub struct Graph {
    modules: Vec<Module>,
    /// Absolute module path → index of the file that holds it (inline
    /// modules map to their file).
    by_path: HashMap<Vec<String>, usize>,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Star,
    Semi,
    Other,
}

/// Tokens of Rust source, without comments, strings and char literals.
fn tokens(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == b'"' {
            i = skip_string(b, i + 1);
            out.push(Tok::Other);
        } else if (c == b'r' || c == b'b') && raw_string_start(b, i).is_some() && !prev_is_ident(b, i) {
            let (hashes, body) = raw_string_start(b, i).unwrap_or((0, i + 1));
            i = skip_raw(b, body, hashes);
            out.push(Tok::Other);
        } else if c == b'b' && b.get(i + 1) == Some(&b'"') && !prev_is_ident(b, i) {
            i = skip_string(b, i + 2);
            out.push(Tok::Other);
        } else if c == b'\'' {
            i = skip_quote(b, i);
            out.push(Tok::Other);
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(src[start..i].to_string()));
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            out.push(Tok::Colons);
            i += 2;
        } else {
            out.push(match c {
                b'{' => Tok::Open,
                b'}' => Tok::Close,
                b',' => Tok::Comma,
                b'*' => Tok::Star,
                b';' => Tok::Semi,
                _ => {
                    if c.is_ascii_whitespace() {
                        i += 1;
                        continue;
                    }
                    Tok::Other
                }
            });
            i += 1;
        }
    }
    out
}

fn prev_is_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// `r"`, `r#"`, `br"`, `br#"` at `i`: the number of hashes and where the
/// body starts.
fn raw_string_start(b: &[u8], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if b.get(j) == Some(&b'b') {
        j += 1;
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while b.get(j) == Some(&b'#') {
        hashes += 1;
        j += 1;
    }
    (b.get(j) == Some(&b'"')).then_some((hashes, j + 1))
}

fn skip_string(b: &[u8], mut i: usize) -> usize {
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

fn skip_raw(b: &[u8], mut i: usize, hashes: usize) -> usize {
    while i < b.len() {
        if b[i] == b'"' && b[i + 1..].iter().take(hashes).filter(|&&h| h == b'#').count() == hashes {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

/// A char literal (`'a'`, `'\n'`, `'\u{1F600}'`) or a lifetime (`'a`).
fn skip_quote(b: &[u8], i: usize) -> usize {
    if b.get(i + 1) == Some(&b'\\') {
        let mut j = i + 2;
        while j < b.len() && b[j] != b'\'' {
            j += 1;
        }
        return j + 1;
    }
    // One character, possibly multi-byte, then a closing quote.
    let mut j = i + 1;
    if j < b.len() {
        j += 1;
        while j < b.len() && (b[j] & 0xC0) == 0x80 {
            j += 1;
        }
    }
    if b.get(j) == Some(&b'\'') {
        return j + 1;
    }
    // A lifetime: the identifier is left for the tokenizer.
    i + 1
}

/// What one file says, before paths are made absolute.
#[derive(Default)]
struct Parsed {
    /// `mod x;` declarations (files to load).
    file_mods: Vec<String>,
    /// Inline `mod x { .. }` names.
    inline_mods: Vec<String>,
    /// Paths as written, with the inline-module nesting they were in.
    paths: Vec<(Vec<String>, Vec<String>)>,
    /// `pub use` entries: (inline nesting, visible name, path as written).
    reexports: Vec<(Vec<String>, String, Vec<String>)>,
}

fn parse(src: &str) -> Parsed {
    let toks = tokens(src);
    let mut p = Parsed::default();
    let mut depth = 0usize;
    // Inline modules open: (name, brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let nesting: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
        match &toks[i] {
            Tok::Open => depth += 1,
            Tok::Close => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(w) if w == "mod" => {
                if let Some(Tok::Ident(name)) = toks.get(i + 1) {
                    match toks.get(i + 2) {
                        Some(Tok::Semi) if inline.is_empty() => p.file_mods.push(name.clone()),
                        Some(Tok::Open) => {
                            if inline.is_empty() {
                                p.inline_mods.push(name.clone());
                            }
                            inline.push((name.clone(), depth + 1));
                        }
                        _ => {}
                    }
                    i += 2;
                    continue;
                }
            }
            Tok::Ident(w) if w == "use" => {
                let public = i > 0 && is_pub_before(&toks, i);
                let mut j = i + 1;
                let mut found = Vec::new();
                use_tree(&toks, &mut j, Vec::new(), &mut found);
                for (path, alias) in found {
                    if public && let Some(name) = alias {
                        p.reexports.push((nesting.clone(), name, path.clone()));
                    }
                    p.paths.push((nesting.clone(), path));
                }
                i = j;
                continue;
            }
            Tok::Ident(w)
                if (w == "crate" || w == "super" || w == "self")
                    && toks.get(i + 1) == Some(&Tok::Colons)
                    && !(i > 0 && toks[i - 1] == Tok::Colons) =>
            {
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Colons) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(seg)) => {
                            path.push(seg.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                p.paths.push((nesting, path));
                i = j;
                continue;
            }
            Tok::Ident(w) if toks.get(i + 1) == Some(&Tok::Colons) && !(i > 0 && toks[i - 1] == Tok::Colons) => {
                // Maybe a child module named from its parent; resolved
                // later against the declared children.
                p.paths.push((nesting, vec!["self".into(), w.clone()]));
            }
            _ => {}
        }
        i += 1;
    }
    p
}

/// `pub`, `pub(crate)`, `pub(super)`, `pub(in ..)` right before `use`.
fn is_pub_before(toks: &[Tok], i: usize) -> bool {
    if toks[i - 1] == Tok::Ident("pub".into()) {
        return true;
    }
    // `pub ( crate )` tokenizes as pub Other Ident Other.
    i >= 4 && toks[i - 4] == Tok::Ident("pub".into())
}

/// Parses a `use` tree at `*j`, pushing each leaf path with the name it
/// is visible as (None for a glob).
fn use_tree(toks: &[Tok], j: &mut usize, prefix: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut path = prefix;
    if toks.get(*j) == Some(&Tok::Colons) {
        *j += 1;
    }
    loop {
        match toks.get(*j) {
            Some(Tok::Ident(seg)) if seg != "as" => {
                path.push(seg.clone());
                *j += 1;
                if toks.get(*j) == Some(&Tok::Colons) {
                    *j += 1;
                    continue;
                }
                let mut name = path.last().cloned();
                if toks.get(*j) == Some(&Tok::Ident("as".into())) {
                    if let Some(Tok::Ident(alias)) = toks.get(*j + 1) {
                        name = Some(alias.clone());
                    }
                    *j += 2;
                }
                if name.as_deref() == Some("self") {
                    path.pop();
                    name = path.last().cloned();
                }
                out.push((path, name));
                break;
            }
            Some(Tok::Star) => {
                *j += 1;
                out.push((path, None));
                break;
            }
            Some(Tok::Open) => {
                *j += 1;
                loop {
                    match toks.get(*j) {
                        Some(Tok::Close) => {
                            *j += 1;
                            break;
                        }
                        Some(Tok::Comma) => *j += 1,
                        None => return,
                        _ => {
                            let before = *j;
                            use_tree(toks, j, path.clone(), out);
                            if *j == before {
                                *j += 1;
                            }
                        }
                    }
                }
                break;
            }
            _ => break,
        }
    }
    // The tree ends at `;` (or at the `,`/`}` of an enclosing group).
    if prefix_is_top(toks, *j) {
        *j += 1;
    }
}

fn prefix_is_top(toks: &[Tok], j: usize) -> bool {
    toks.get(j) == Some(&Tok::Semi)
}

impl Graph {
    /// Loads the module tree under `root` (a crate root file).
    pub fn load(root: &Path) -> std::io::Result<Graph> {
        let mut g = Graph { modules: Vec::new(), by_path: HashMap::new() };
        let mut parsed = Vec::new();
        let mut queue = vec![(root.to_path_buf(), Vec::<String>::new())];
        while let Some((file, path)) = queue.pop() {
            let src = std::fs::read_to_string(&file)?;
            let p = parse(&src);
            let dir = module_dir(&file, path.is_empty());
            for m in &p.file_mods {
                let a = dir.join(format!("{m}.rs"));
                let b = dir.join(m).join("mod.rs");
                let child = if a.exists() { a } else { b };
                if child.exists() {
                    let mut cp = path.clone();
                    cp.push(m.clone());
                    queue.push((child, cp));
                }
            }
            let idx = g.modules.len();
            g.by_path.insert(path.clone(), idx);
            for m in &p.inline_mods {
                let mut cp = path.clone();
                cp.push(m.clone());
                g.by_path.insert(cp, idx);
            }
            let mut module = Module { file, path, ..Module::default() };
            module.children.extend(p.file_mods.iter().cloned());
            module.children.extend(p.inline_mods.iter().cloned());
            g.modules.push(module);
            parsed.push(p);
        }
        for (idx, p) in parsed.iter().enumerate() {
            for (nesting, name, written) in &p.reexports {
                if let Some(abs) = g.absolute(idx, nesting, written) {
                    g.modules[idx].reexports.insert(name.clone(), abs);
                }
            }
        }
        for (idx, p) in parsed.iter().enumerate() {
            for (nesting, written) in &p.paths {
                if let Some(abs) = g.absolute(idx, nesting, written) {
                    g.modules[idx].uses.push(abs);
                }
            }
        }
        Ok(g)
    }

    /// A written path made absolute, or None when it names another crate
    /// (or nothing this graph knows).
    fn absolute(&self, idx: usize, nesting: &[String], written: &[String]) -> Option<Vec<String>> {
        let mut here = self.modules[idx].path.clone();
        here.extend(nesting.iter().cloned());
        let mut segs = written.iter();
        let first = segs.next()?;
        let mut abs = match first.as_str() {
            "crate" => Vec::new(),
            "self" => here,
            "super" => {
                here.pop();
                here
            }
            _ => {
                // Edition 2018 paths: a leading name is a child module of
                // the current module, or another crate.
                let mut m = here;
                m.push(first.clone());
                if !self.by_path.contains_key(&m) {
                    return None;
                }
                m
            }
        };
        let rest: Vec<&String> = segs.collect();
        let mut k = 0;
        while k < rest.len() && rest[k] == "super" {
            abs.pop();
            k += 1;
        }
        abs.extend(rest[k..].iter().map(|s| (*s).clone()));
        // `self::name` in code is only a path when `name` is a module here.
        if first == "self" && written.len() == 2 && !self.by_path.contains_key(&abs) {
            return None;
        }
        Some(abs)
    }

    /// The file that defines what `abs` names, following re-exports.
    fn resolve(&self, abs: &[String]) -> Option<usize> {
        let mut abs = abs.to_vec();
        for _ in 0..MAX_REEXPORT_HOPS {
            // The longest prefix that is a module.
            let mut n = abs.len();
            while n > 0 && !self.by_path.contains_key(&abs[..n]) {
                n -= 1;
            }
            let idx = *self.by_path.get(&abs[..n])?;
            let Some(item) = abs.get(n) else {
                return Some(idx);
            };
            match self.modules[idx].reexports.get(item) {
                Some(target) if target.as_slice() != &abs[..n + 1] => {
                    let mut next = target.clone();
                    next.extend(abs[n + 1..].iter().cloned());
                    abs = next;
                }
                _ => return Some(idx),
            }
        }
        None
    }

    /// Edges between distinct files, as (from, to) indices.
    fn edges(&self) -> BTreeSet<(usize, usize)> {
        let mut out = BTreeSet::new();
        for (idx, m) in self.modules.iter().enumerate() {
            for u in &m.uses {
                if let Some(to) = self.resolve(u)
                    && to != idx
                {
                    out.insert((idx, to));
                }
            }
        }
        out
    }

    /// Every cycle (a strongly connected set of two or more files), each
    /// as its files relative to `base`, sorted.
    pub fn cycles(&self, base: &Path) -> Vec<Vec<String>> {
        let edges = self.edges();
        let n = self.modules.len();
        let mut adj = vec![Vec::new(); n];
        for &(a, b) in &edges {
            adj[a].push(b);
        }
        let comps = strongly_connected(&adj);
        let mut out: Vec<Vec<String>> = comps
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| {
                let mut names: Vec<String> = c
                    .iter()
                    .map(|&i| {
                        let f = &self.modules[i].file;
                        f.strip_prefix(base).unwrap_or(f).display().to_string()
                    })
                    .collect();
                names.sort();
                names
            })
            .collect();
        out.sort();
        out
    }

    /// For a report: each file's edges, by file name.
    pub fn edge_list(&self, base: &Path) -> BTreeMap<String, BTreeSet<String>> {
        let name = |i: usize| {
            let f = &self.modules[i].file;
            f.strip_prefix(base).unwrap_or(f).display().to_string()
        };
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in self.edges() {
            out.entry(name(a)).or_default().insert(name(b));
        }
        out
    }
}

/// Where the files of `file`'s child modules live.
fn module_dir(file: &Path, is_root: bool) -> PathBuf {
    let parent = file.parent().unwrap_or(Path::new("."));
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if is_root || stem == "mod" { parent.to_path_buf() } else { parent.join(stem) }
}

/// Tarjan's algorithm, iteratively (no recursion depth to bound).
fn strongly_connected(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = adj.len();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut comps = Vec::new();
    let mut next = 0;
    for start in 0..n {
        if index[start] != usize::MAX {
            continue;
        }
        let mut work = vec![(start, 0usize)];
        while let Some(&mut (v, ref mut ei)) = work.last_mut() {
            if *ei == 0 && index[v] == usize::MAX {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = adj[v].get(*ei) {
                *ei += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(u, _)) = work.last() {
                low[u] = low[u].min(low[v]);
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                comps.push(comp);
            }
        }
    }
    comps
}

/// The crate roots under a crate directory: `src/lib.rs`, `src/main.rs`
/// and `src/bin/*.rs`.
pub fn crate_roots(crate_dir: &Path) -> Vec<PathBuf> {
    let src = crate_dir.join("src");
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.exists()).collect();
    if let Ok(dir) = std::fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> =
            dir.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "rs")).collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let p = dir.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }

    fn cycles_of(files: &[(&str, &str)]) -> Vec<Vec<String>> {
        let dir = std::env::temp_dir().join(format!("dmkv-layers-{}-{}", std::process::id(), rand::random::<u64>()));
        write(&dir, files);
        let g = Graph::load(&dir.join("lib.rs")).unwrap();
        let c = g.cycles(&dir);
        std::fs::remove_dir_all(&dir).ok();
        c
    }

    #[test]
    fn a_use_cycle_is_found() {
        let c = cycles_of(&[
            ("lib.rs", "mod a; mod b; mod c;"),
            ("a.rs", "use crate::b::Thing; pub struct A;"),
            ("b.rs", "use crate::{c::{self, Other as O}}; pub struct Thing;"),
            ("c.rs", "pub fn f() -> crate::a::A { todo!() } pub struct Other;"),
        ]);
        assert_eq!(c, vec![vec!["a.rs", "b.rs", "c.rs"]]);
    }

    #[test]
    fn layers_without_a_way_back_are_not_a_cycle() {
        let c = cycles_of(&[
            ("lib.rs", "mod a; mod b; pub use a::A; pub use b::B;"),
            ("a.rs", "use crate::B; pub struct A(B);"),
            (
                "b.rs",
                "// use crate::a::A;\n/// [`crate::A`]\npub struct B(&'static str, char);\nconst S: &str = \"crate::a::A\"; const C: char = 'x';",
            ),
        ]);
        assert!(c.is_empty(), "{c:?}");
    }

    #[test]
    fn super_paths_and_child_modules_count() {
        let c = cycles_of(&[
            ("lib.rs", "mod m;"),
            ("m/mod.rs", "mod x; pub struct Top; fn f() { x::go() }"),
            ("m/x.rs", "pub fn go() { let _ = super::Top; }"),
        ]);
        assert_eq!(c, vec![vec!["m/mod.rs", "m/x.rs"]]);
        let c = cycles_of(&[
            ("lib.rs", "mod m;"),
            ("m/mod.rs", "mod x; mod tests { use super::*; }"),
            ("m/x.rs", "pub fn go() { let _ = super::Top; } mod t { use super::go; }"),
        ]);
        assert!(c.is_empty(), "{c:?}");
    }
}
