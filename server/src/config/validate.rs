//! Checks of dmkvd's settings made before anything starts: the region
//! against the layout's limits and the machine's memory, the buckets
//! against the region, and paths against the file system.
//!
//! A failed start prints one line, so each error names the setting (the
//! flag, or the key of the config file that gave it) and the value or path
//! at fault: "cannot start" alone leaves a newcomer guessing which of a
//! dozen settings to change.

use std::path::Path;

use dmkv_common::layout::RegionHeader;
use dmkv_common::limits::{BUCKET_LEN, MAX_REGION_LEN, MIN_REGION_LEN};

/// Longest path a Unix socket can bind (`sun_path` holds 108 bytes with
/// its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How an error names setting `key`: `--key-name` when a flag gave it or
/// it is the default (the flag is what changes it), `FILE: key` when the
/// config file gave it.
pub fn setting_name(key: &str, from_file: bool, config: Option<&Path>) -> String {
    match config {
        Some(path) if from_file => format!("{}: {key}", path.display()),
        _ => format!("--{}", key.replace('_', "-")),
    }
}

/// A byte count as people write it: "4 MiB", "1.5 GiB", "1000 bytes".
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// This machine's physical memory (MemTotal in /proc/meminfo); `None`
/// where it cannot be read, and then the region is not checked against it.
pub fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Checks the region size (`memory`) against the layout's limits and the
/// machine's `physical` memory, then that `buckets` leave room for data in
/// it. `memory_name` and `buckets_name` name the settings; `buckets_given`
/// says whether the buckets were set (else they follow from the memory).
pub fn region(
    memory: u64,
    memory_name: &str,
    buckets: u64,
    buckets_name: Option<&str>,
    physical: Option<u64>,
) -> Result<(), String> {
    if memory < MIN_REGION_LEN as u64 {
        return Err(format!(
            "{memory_name}: {} is below the smallest region dmkvd accepts, {}",
            human(memory),
            human(MIN_REGION_LEN as u64)
        ));
    }
    // A region the machine cannot hold gets the server killed later, under
    // load, instead of refused now.
    if let Some(total) = physical.filter(|&t| memory > t) {
        return Err(format!(
            "{memory_name}: {} ({memory} bytes) is more than this machine's physical memory, {} ({total} bytes)",
            human(memory),
            human(total)
        ));
    }
    if memory > MAX_REGION_LEN {
        return Err(format!(
            "{memory_name}: {} is above the largest region dmkv can address, {}",
            human(memory),
            human(MAX_REGION_LEN)
        ));
    }
    // The region is read and written in whole 8-byte words.
    if !memory.is_multiple_of(8) {
        return Err(format!("{memory_name}: {memory} bytes is not a multiple of 8 bytes"));
    }
    if buckets == 0 || !buckets.is_power_of_two() {
        let name = buckets_name.unwrap_or("--buckets");
        return Err(format!("{name}: {buckets} is not a power of two"));
    }
    if fits(memory, buckets) {
        return Ok(());
    }
    let most = (0..64).map(|shift| 1u64 << shift).take_while(|&b| fits(memory, b)).last();
    let index = buckets.saturating_mul(BUCKET_LEN as u64);
    match (buckets_name, most) {
        (Some(name), Some(most)) => Err(format!(
            "{name}: {buckets} buckets need a {} index, which leaves no room for data in a {} region \
             ({memory_name}); at most {most} buckets fit, or give more memory",
            human(index),
            human(memory)
        )),
        _ => Err(format!("{memory_name}: {} is too small to lay out a region", human(memory))),
    }
}

/// Whether a region of `memory` bytes holds the index of `buckets` and at
/// least one item of the largest size.
fn fits(memory: u64, buckets: u64) -> bool {
    RegionHeader::plan(memory, crate::store::initial_segments(buckets), 0, 1, 0).is_ok()
}

/// Checks that the directory `path` is to be created in exists, for a
/// socket or directory dmkvd creates at start.
pub fn parent_exists(name: &str, path: &Path) -> Result<(), String> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        // A bare file name: the working directory, which exists.
        _ => return Ok(()),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("{name} {}: {} is not a directory", path.display(), parent.display())),
        Err(e) => Err(format!("{name} {}: directory {}: {}", path.display(), parent.display(), plain(&e))),
    }
}

/// Checks that directory `path` exists or can be made with its parents
/// (as the data directory is, at start): its nearest existing ancestor
/// must be a directory.
pub fn creatable_dir(name: &str, path: &Path) -> Result<(), String> {
    for dir in path.ancestors().filter(|a| !a.as_os_str().is_empty()) {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => return Ok(()),
            Ok(_) => return Err(format!("{name} {}: {} is not a directory", path.display(), dir.display())),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => continue,
            Err(e) => return Err(format!("{name} {}: {}: {}", path.display(), dir.display(), plain(&e))),
        }
    }
    // A relative path whose every ancestor is missing: the working directory.
    Ok(())
}

/// Checks that `path` is a file dmkvd can read.
pub fn readable_file(name: &str, path: &Path) -> Result<(), String> {
    match std::fs::File::open(path).and_then(|f| f.metadata()) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(format!("{name} {}: not a regular file", path.display())),
        Err(e) => Err(format!("{name} {}: cannot read it: {}", path.display(), plain(&e))),
    }
}

/// Reads the file `path` for setting `name`.
pub fn read_text(name: &str, path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{name} {}: cannot read it: {}", path.display(), plain(&e)))
}

/// An I/O error without the "(os error N)" suffix, which tells a reader
/// nothing the text did not.
pub fn plain(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// A TOML error on one line ("line 3: invalid size ..."): the library's
/// own rendering spans several lines, and a failed start prints one.
pub fn toml_error(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().lines().collect::<Vec<_>>().join("; ");
    match e.span() {
        Some(span) => {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            format!("line {line}: {message}")
        }
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(4 << 20), "4 MiB");
        assert_eq!(human(1 << 40), "1 TiB");
        assert_eq!(human(3 * GIB / 2), "1.5 GiB");
        assert_eq!(human(1000), "1000 bytes");
    }

    #[test]
    fn mem_total_parses() {
        assert_eq!(parse_mem_total("MemFree: 1 kB\nMemTotal:       16318412 kB\n"), Some(16318412 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn region_limits_name_the_setting_and_both_numbers() {
        let err = region(1 << 20, "--memory", 256, None, None).unwrap_err();
        assert!(err.starts_with("--memory: 1 MiB is below the smallest region dmkvd accepts, 4 MiB"), "{err}");
        let err = region(64 * GIB, "dmkvd.toml: memory", 1024, None, Some(16 * GIB)).unwrap_err();
        assert!(err.contains("dmkvd.toml: memory: 64 GiB") && err.contains("physical memory, 16 GiB"), "{err}");
        let err = region(1 << 40, "--memory", 1024, None, Some(4 << 40)).unwrap_err();
        assert!(err.contains("above the largest region dmkv can address, 512 GiB"), "{err}");
        assert!(region(MIN_REGION_LEN as u64, "--memory", 1024, None, Some(GIB)).is_ok());
        assert!(region(MIN_REGION_LEN as u64 + 1, "--memory", 1024, None, None).unwrap_err().contains("multiple of 8"));
    }

    #[test]
    fn buckets_must_leave_room_for_data() {
        let err = region(4 << 20, "--memory", 1 << 20, Some("--buckets"), None).unwrap_err();
        assert!(err.starts_with("--buckets: 1048576 buckets need a 128 MiB index"), "{err}");
        assert!(err.contains("at most 16384 buckets fit"), "{err}");
        assert!(region(4 << 20, "--memory", 16384, Some("--buckets"), None).is_ok());
        assert!(region(4 << 20, "--memory", 1000, Some("--buckets"), None).unwrap_err().contains("power of two"));
    }

    #[test]
    fn parents_and_files_are_named() {
        let err = parent_exists("--shm-socket", Path::new("/nonexistent-dmkv-dir/x.sock")).unwrap_err();
        assert_eq!(
            err,
            "--shm-socket /nonexistent-dmkv-dir/x.sock: directory /nonexistent-dmkv-dir: No such file or directory"
        );
        assert!(parent_exists("--shm-socket", Path::new("x.sock")).is_ok());
        assert!(creatable_dir("--data-dir", Path::new("/nonexistent-dmkv-dir/a/b")).is_ok());
        let file = std::env::temp_dir().join(format!("dmkv-validate-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let err = creatable_dir("--data-dir", &file.join("d")).unwrap_err();
        assert!(err.ends_with("is not a directory"), "{err}");
        let _ = std::fs::remove_file(&file);
        let err = readable_file("--tls-cert", Path::new("/nonexistent-dmkv.pem")).unwrap_err();
        assert!(err.starts_with("--tls-cert /nonexistent-dmkv.pem: cannot read it"), "{err}");
    }

    #[test]
    fn settings_are_named_by_where_they_came_from() {
        assert_eq!(setting_name("shm_socket", false, None), "--shm-socket");
        assert_eq!(setting_name("shm_socket", true, Some(Path::new("d.toml"))), "d.toml: shm_socket");
        assert_eq!(setting_name("shm_socket", false, Some(Path::new("d.toml"))), "--shm-socket");
    }
}
