//! Authentication: roles, shared secrets, and the challenge-response every
//! listener uses. Pure logic; the caller supplies nonces and the time.
//!
//! The server sends a fresh random nonce; the client answers with
//! `HMAC-SHA256(secret, DOMAIN | purpose | nonce)`. The secret never
//! crosses the wire, a proof is good for one nonce (one connection) only,
//! and the purpose keeps a proof for one listener from being replayed at
//! another. The server checks a proof against every secret it knows, in
//! constant time, and grants the role of the secret that made it: clients
//! do not claim a role, they prove one.
//!
//! Cluster nodes have secrets of their own, one identity each: a node
//! proves its secret on a peer's peer port (purpose [`Purpose::Peer`]) and
//! is granted "node N", which is no role: it allows raft traffic from node
//! N and nothing on the client port, and no role's secret allows raft.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a server nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a client's proof (an HMAC-SHA256 tag).
pub const PROOF_LEN: usize = 32;
/// Shortest secret accepted: 16 bytes (128 bits if random).
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest secret accepted.
pub const MAX_TOKEN_LEN: usize = 1024;
/// Most secrets per role (several allow rotating them without downtime).
pub const MAX_TOKENS_PER_ROLE: usize = 16;
/// Most secrets per cluster node: enough to rotate one. A peer checks a
/// proof against every node's secrets, so this bounds that work too.
pub const MAX_TOKENS_PER_NODE: usize = 4;
/// Largest node id (raft ids hold a node's id in 32 bits).
pub const MAX_NODE_ID: u64 = u32::MAX as u64;
/// Failed attempts one peer address may make per [`FAILURE_WINDOW`] before
/// it is refused without a check.
pub const MAX_FAILURES: u32 = 5;
/// How long failures are remembered, and how long a blocked peer waits.
pub const FAILURE_WINDOW: Duration = Duration::from_secs(10);
/// Most peer addresses whose failures are remembered; beyond it the
/// oldest are forgotten, so a spoofing flood cannot grow the table.
pub const MAX_TRACKED_PEERS: usize = 4096;

/// Bytes of a listener's greeting: an 8-byte magic naming the listener, a
/// flags byte and the nonce (the engine and the shm handoff speak first).
pub const GREETING_LEN: usize = 8 + 1 + NONCE_LEN;
/// Greeting flag: the client must prove a secret.
pub const GREETING_AUTH_REQUIRED: u8 = 1;

/// The greeting a listener named by `magic` sends on a new connection.
pub fn encode_greeting(magic: &[u8; 8], auth_required: bool, nonce: &[u8; NONCE_LEN]) -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[..8].copy_from_slice(magic);
    g[8] = if auth_required { GREETING_AUTH_REQUIRED } else { 0 };
    g[9..].copy_from_slice(nonce);
    g
}

/// Whether a greeting from the listener named by `magic` asks for
/// authentication, and its nonce. Refuses other magics and unknown flags.
pub fn decode_greeting(magic: &[u8; 8], g: &[u8; GREETING_LEN]) -> Result<(bool, [u8; NONCE_LEN]), BadGreeting> {
    if g[..8] != magic[..] {
        return Err(BadGreeting::Magic);
    }
    if g[8] & !GREETING_AUTH_REQUIRED != 0 {
        return Err(BadGreeting::Flags);
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&g[9..]);
    Ok((g[8] & GREETING_AUTH_REQUIRED != 0, nonce))
}

/// Why a greeting was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadGreeting {
    /// Not the listener the client meant to reach.
    Magic,
    /// Flags this build does not know.
    Flags,
}

/// What a client answers a greeting with: its proof for `nonce` when the
/// listener asks for one, zeros when it does not (a proof would only tell
/// a listener that did not ask that this client has a secret). `None`: it
/// asks and the client has no token.
pub fn answer(required: bool, token: Option<&Token>, purpose: Purpose, nonce: &[u8]) -> Option<[u8; PROOF_LEN]> {
    match (required, token) {
        (false, _) => Some([0u8; PROOF_LEN]),
        (true, Some(t)) => Some(t.prove(purpose, nonce)),
        (true, None) => None,
    }
}

/// Separates dmkv's proofs from any other use of the same secret.
const DOMAIN: &[u8] = b"dmkv-auth-v1";

/// What a connection may do. Ordered: a role allows everything the roles
/// below it allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// GET, PUT, DELETE, STATS and one-sided reads.
    Data,
    /// Everything `Data` may, REREGISTER and operators' cluster requests
    /// (REPLACE_REPLICA). Not raft traffic: that takes a node's secret.
    Admin,
}

impl Role {
    /// Whether this role may do what `needed` allows.
    pub fn allows(self, needed: Role) -> bool {
        self >= needed
    }

    /// The role's name in config files and replies.
    pub fn name(self) -> &'static str {
        match self {
            Role::Data => "data",
            Role::Admin => "admin",
        }
    }

    /// The role named `s`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "data" => Some(Role::Data),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// Which listener a proof is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Rpc,
    Engine,
    Shm,
    /// A cluster node's peer port, where nodes prove their node secret.
    Peer,
}

impl Purpose {
    fn tag(self) -> &'static [u8] {
        match self {
            Purpose::Rpc => b"rpc",
            Purpose::Engine => b"engine",
            Purpose::Shm => b"shm",
            Purpose::Peer => b"peer",
        }
    }
}

/// How a node identity is written in auth files and in the AUTHENTICATE
/// reply of the peer port: `node:N`.
pub fn node_name(node: u64) -> String {
    format!("node:{node}")
}

/// The node id of a `node:N` name (N from 1 to [`MAX_NODE_ID`]); `None`
/// when `s` does not start with `node:`, an error when N is not an id.
pub fn parse_node_name(s: &str) -> Option<Result<u64, String>> {
    let id = s.strip_prefix("node:")?;
    Some(match id.parse::<u64>() {
        // Digits only: `u64::from_str` would take a leading `+`.
        Ok(n @ 1..=MAX_NODE_ID) if id.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
        _ => Err(format!("{s:?}: a node id is a number from 1 to {MAX_NODE_ID}")),
    })
}

/// A shared secret. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(Vec<u8>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token(<{} bytes>)", self.0.len())
    }
}

impl Token {
    /// A secret from its text, surrounding whitespace removed (files end
    /// in newlines). Refuses secrets too short to resist guessing.
    pub fn new(text: &str) -> Result<Token, String> {
        let t = text.trim();
        if t.len() < MIN_TOKEN_LEN {
            return Err(format!("a token must be at least {MIN_TOKEN_LEN} characters (got {})", t.len()));
        }
        if t.len() > MAX_TOKEN_LEN {
            return Err(format!("a token must be at most {MAX_TOKEN_LEN} characters (got {})", t.len()));
        }
        if t.chars().any(char::is_whitespace) {
            return Err("a token may not contain whitespace".into());
        }
        Ok(Token(t.as_bytes().to_vec()))
    }

    fn mac(&self, purpose: Purpose, nonce: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(DOMAIN);
        m.update(purpose.tag());
        m.update(nonce);
        m
    }

    /// The proof a client sends for `nonce` on a `purpose` listener.
    pub fn prove(&self, purpose: Purpose, nonce: &[u8]) -> [u8; PROOF_LEN] {
        self.mac(purpose, nonce).finalize().into_bytes().into()
    }

    /// Whether `proof` was made with this secret (constant time).
    fn verifies(&self, purpose: Purpose, nonce: &[u8], proof: &[u8]) -> bool {
        self.mac(purpose, nonce).verify_slice(proof).is_ok()
    }
}

/// The server's secrets, by role, and the cluster nodes' secrets, by node.
/// Empty: authentication is off.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    data: Vec<Token>,
    admin: Vec<Token>,
    /// Each node's secrets; the first is the one a node proves.
    nodes: BTreeMap<u64, Vec<Token>>,
}

impl Keys {
    /// Keys from the secrets of each role.
    pub fn new(data: Vec<Token>, admin: Vec<Token>) -> Result<Keys, String> {
        Keys { data, admin, nodes: BTreeMap::new() }.checked()
    }

    /// These keys with cluster nodes' secrets: `nodes[N]` are node N's,
    /// the first of them the one node N proves to its peers.
    pub fn with_nodes(self, nodes: BTreeMap<u64, Vec<Token>>) -> Result<Keys, String> {
        Keys { nodes, ..self }.checked()
    }

    /// Refuses lists too long, and a secret with two owners: a proof must
    /// name one role or one node, or the identity it grants is a guess.
    fn checked(self) -> Result<Keys, String> {
        for (role, list) in [("data", &self.data), ("admin", &self.admin)] {
            if list.len() > MAX_TOKENS_PER_ROLE {
                return Err(format!("more than {MAX_TOKENS_PER_ROLE} {role} tokens"));
            }
        }
        if self.data.iter().any(|d| self.admin.contains(d)) {
            return Err("a token cannot be both a data and an admin token".into());
        }
        let roles: HashSet<&Token> = self.data.iter().chain(&self.admin).collect();
        let mut owner: HashMap<&Token, u64> = HashMap::new();
        for (&node, list) in &self.nodes {
            if !(1..=MAX_NODE_ID).contains(&node) {
                return Err(format!("node {node}: a node id is a number from 1 to {MAX_NODE_ID}"));
            }
            if list.len() > MAX_TOKENS_PER_NODE {
                return Err(format!("more than {MAX_TOKENS_PER_NODE} tokens for node {node}"));
            }
            for t in list {
                if roles.contains(t) {
                    return Err(format!("node {node}'s token is also a data or admin token: give nodes their own"));
                }
                match owner.insert(t, node) {
                    Some(other) if other != node => {
                        return Err(format!("nodes {other} and {node} have the same token: each needs its own"));
                    }
                    _ => {}
                }
            }
        }
        Ok(self)
    }

    /// The secret node `node` proves itself with to its peers (its first).
    pub fn node_token(&self, node: u64) -> Option<&Token> {
        self.nodes.get(&node).and_then(|l| l.first())
    }

    /// The nodes that have secrets.
    pub fn nodes(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter(|(_, l)| !l.is_empty()).map(|(&n, _)| n)
    }

    /// Whether there is a data or admin secret (a client can get in).
    pub fn has_roles(&self) -> bool {
        !self.data.is_empty() || !self.admin.is_empty()
    }

    /// Whether authentication is on.
    pub fn enabled(&self) -> bool {
        self.has_roles() || self.nodes().next().is_some()
    }

    /// The role whose secret made `proof` for `nonce`, if any. Every secret
    /// is checked (no early exit), so timing says nothing about which one
    /// matched or how close a guess came. Node secrets grant no role.
    pub fn verify(&self, purpose: Purpose, nonce: &[u8], proof: &[u8]) -> Option<Role> {
        let mut role = None;
        for t in &self.data {
            if t.verifies(purpose, nonce, proof) {
                role = role.max(Some(Role::Data));
            }
        }
        for t in &self.admin {
            if t.verifies(purpose, nonce, proof) {
                role = role.max(Some(Role::Admin));
            }
        }
        role
    }

    /// The node whose secret made `proof` for `nonce`, if any. Every
    /// node's every secret is checked (no early exit); role secrets are
    /// not: they never make a node.
    pub fn verify_node(&self, purpose: Purpose, nonce: &[u8], proof: &[u8]) -> Option<u64> {
        let mut node = None;
        for (&n, list) in &self.nodes {
            for t in list {
                if t.verifies(purpose, nonce, proof) {
                    // No secret has two owners (`checked`): at most one match.
                    node = Some(n);
                }
            }
        }
        node
    }
}

/// What to do about one failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Log it.
    Log,
    /// The peer just crossed [`MAX_FAILURES`]: log that it is now blocked.
    Blocked,
    /// Already blocked: stay quiet (one log line per window, not per try).
    Quiet,
}

#[derive(Debug, Clone, Copy)]
struct Record {
    since: Instant,
    failures: u32,
}

/// Failed authentication attempts per peer address, to slow guessing down:
/// after [`MAX_FAILURES`] failures within [`FAILURE_WINDOW`], the peer is
/// refused without a check until the window has passed.
#[derive(Debug, Default)]
pub struct FailureLimiter {
    peers: HashMap<IpAddr, Record>,
}

impl FailureLimiter {
    /// Whether `peer` may try to authenticate at `now`.
    pub fn allowed(&self, peer: IpAddr, now: Instant) -> bool {
        self.peers.get(&peer).is_none_or(|r| r.failures < MAX_FAILURES || now.duration_since(r.since) >= FAILURE_WINDOW)
    }

    /// Records a failed attempt by `peer` at `now`.
    pub fn failed(&mut self, peer: IpAddr, now: Instant) -> Failure {
        if !self.peers.contains_key(&peer) && self.peers.len() >= MAX_TRACKED_PEERS {
            self.peers.retain(|_, r| now.duration_since(r.since) < FAILURE_WINDOW);
            if self.peers.len() >= MAX_TRACKED_PEERS
                && let Some(oldest) = self.peers.iter().min_by_key(|(_, r)| r.since).map(|(ip, _)| *ip)
            {
                self.peers.remove(&oldest);
            }
        }
        let r = self.peers.entry(peer).or_insert(Record { since: now, failures: 0 });
        if now.duration_since(r.since) >= FAILURE_WINDOW {
            *r = Record { since: now, failures: 0 };
        }
        r.failures = r.failures.saturating_add(1);
        match r.failures.cmp(&MAX_FAILURES) {
            std::cmp::Ordering::Less => Failure::Log,
            std::cmp::Ordering::Equal => Failure::Blocked,
            std::cmp::Ordering::Greater => Failure::Quiet,
        }
    }

    /// Peers remembered now.
    pub fn tracked(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(s: &str) -> Token {
        Token::new(s).unwrap()
    }

    #[test]
    fn proofs_grant_the_role_of_their_secret() {
        let keys = Keys::new(vec![tok("data-secret-0123456789")], vec![tok("admin-secret-0123456789")]).unwrap();
        let nonce = [7u8; NONCE_LEN];
        let d = tok("data-secret-0123456789").prove(Purpose::Rpc, &nonce);
        let a = tok("admin-secret-0123456789").prove(Purpose::Rpc, &nonce);
        assert_eq!(keys.verify(Purpose::Rpc, &nonce, &d), Some(Role::Data));
        assert_eq!(keys.verify(Purpose::Rpc, &nonce, &a), Some(Role::Admin));
        // Another nonce, another listener, another secret, a cut proof: no.
        assert_eq!(keys.verify(Purpose::Rpc, &[8u8; NONCE_LEN], &d), None);
        assert_eq!(keys.verify(Purpose::Engine, &nonce, &d), None);
        assert_eq!(
            keys.verify(Purpose::Rpc, &nonce, &tok("wrong-secret-0123456789").prove(Purpose::Rpc, &nonce)),
            None
        );
        assert_eq!(keys.verify(Purpose::Rpc, &nonce, &d[..31]), None);
        assert_eq!(keys.verify(Purpose::Rpc, &nonce, &[]), None);
        assert!(Role::Admin.allows(Role::Data) && !Role::Data.allows(Role::Admin));
    }

    fn node_keys() -> Keys {
        let nodes = BTreeMap::from([
            (1, vec![tok("node-1-secret-0123456789")]),
            (2, vec![tok("node-2-secret-0123456789"), tok("node-2-next-0123456789")]),
        ]);
        Keys::new(vec![tok("data-secret-0123456789")], vec![tok("admin-secret-0123456789")])
            .unwrap()
            .with_nodes(nodes)
            .unwrap()
    }

    #[test]
    fn node_secrets_grant_their_node_and_nothing_else() {
        let keys = node_keys();
        let nonce = [9u8; NONCE_LEN];
        let n2 = tok("node-2-secret-0123456789").prove(Purpose::Peer, &nonce);
        assert_eq!(keys.verify_node(Purpose::Peer, &nonce, &n2), Some(2));
        // Either of a node's secrets (a rotation), but it proves its first.
        let next = tok("node-2-next-0123456789").prove(Purpose::Peer, &nonce);
        assert_eq!(keys.verify_node(Purpose::Peer, &nonce, &next), Some(2));
        assert_eq!(keys.node_token(2), Some(&tok("node-2-secret-0123456789")));
        assert_eq!(keys.node_token(3), None);
        assert_eq!(keys.nodes().collect::<Vec<_>>(), vec![1, 2]);
        // A node secret is no role, and a role secret is no node.
        assert_eq!(keys.verify(Purpose::Peer, &nonce, &n2), None);
        let n2_rpc = tok("node-2-secret-0123456789").prove(Purpose::Rpc, &nonce);
        assert_eq!(keys.verify(Purpose::Rpc, &nonce, &n2_rpc), None);
        let admin = tok("admin-secret-0123456789").prove(Purpose::Peer, &nonce);
        assert_eq!(keys.verify_node(Purpose::Peer, &nonce, &admin), None);
        // Another purpose, another nonce, a cut proof: no node.
        assert_eq!(keys.verify_node(Purpose::Peer, &nonce, &n2_rpc), None);
        assert_eq!(keys.verify_node(Purpose::Peer, &[1u8; NONCE_LEN], &n2), None);
        assert_eq!(keys.verify_node(Purpose::Peer, &nonce, &n2[..31]), None);
        // Node secrets alone turn authentication on, but let no client in.
        let only = Keys::default().with_nodes(BTreeMap::from([(1, vec![tok("node-1-secret-0123456789")])])).unwrap();
        assert!(only.enabled() && !only.has_roles());
    }

    #[test]
    fn a_secret_has_one_owner() {
        let t = || tok("shared-secret-0123456789");
        let two_nodes = BTreeMap::from([(1, vec![t()]), (2, vec![t()])]);
        let err = Keys::default().with_nodes(two_nodes).unwrap_err();
        assert!(err.contains("nodes 1 and 2 have the same token"), "{err}");
        let admin = Keys::new(vec![], vec![t()]).unwrap();
        let err = admin.with_nodes(BTreeMap::from([(3, vec![t()])])).unwrap_err();
        assert!(err.contains("node 3's token is also a data or admin token"), "{err}");
        let many = (0..=MAX_TOKENS_PER_NODE).map(|i| tok(&format!("node-secret-{i}-0123456789"))).collect();
        assert!(Keys::default().with_nodes(BTreeMap::from([(1, many)])).is_err());
        assert!(Keys::default().with_nodes(BTreeMap::from([(0, vec![t()])])).is_err());
        assert!(Keys::default().with_nodes(BTreeMap::from([(MAX_NODE_ID + 1, vec![t()])])).is_err());
        // The same secret twice for one node is only redundant.
        assert!(Keys::default().with_nodes(BTreeMap::from([(1, vec![t(), t()])])).is_ok());
    }

    #[test]
    fn node_names_parse() {
        assert_eq!(node_name(7), "node:7");
        assert_eq!(parse_node_name("node:7"), Some(Ok(7)));
        assert_eq!(parse_node_name(&node_name(MAX_NODE_ID)), Some(Ok(MAX_NODE_ID)));
        for bad in ["node:0", "node:", "node:+7", "node:x", "node:-1", "node:4294967296", "node: 7"] {
            assert!(matches!(parse_node_name(bad), Some(Err(_))), "{bad}");
        }
        assert_eq!(parse_node_name("admin"), None);
        assert_eq!(parse_node_name("nodes:1"), None);
    }

    #[test]
    fn greetings_round_trip_and_answers_prove_only_when_asked() {
        let nonce = [3u8; NONCE_LEN];
        let g = encode_greeting(b"DMKVTEST", true, &nonce);
        assert_eq!(decode_greeting(b"DMKVTEST", &g), Ok((true, nonce)));
        assert_eq!(decode_greeting(b"DMKVOTHR", &g), Err(BadGreeting::Magic));
        let mut flags = g;
        flags[8] = 0x80;
        assert_eq!(decode_greeting(b"DMKVTEST", &flags), Err(BadGreeting::Flags));
        let t = tok("0123456789abcdef");
        assert_eq!(answer(false, Some(&t), Purpose::Shm, &nonce), Some([0; PROOF_LEN]));
        assert_eq!(answer(true, Some(&t), Purpose::Shm, &nonce), Some(t.prove(Purpose::Shm, &nonce)));
        assert_eq!(answer(true, None, Purpose::Shm, &nonce), None);
    }

    #[test]
    fn weak_or_odd_tokens_are_refused() {
        assert!(Token::new("short").is_err());
        assert!(Token::new("has a space in it 0123").is_err());
        assert!(Token::new(&"x".repeat(MAX_TOKEN_LEN + 1)).is_err());
        assert_eq!(Token::new("  0123456789abcdef\n").unwrap(), tok("0123456789abcdef"));
        assert!(!format!("{:?}", tok("0123456789abcdef")).contains("0123"));
        assert!(Keys::new(vec![tok("0123456789abcdef")], vec![tok("0123456789abcdef")]).is_err());
        assert!(!Keys::default().enabled());
    }

    #[test]
    fn repeated_failures_block_a_peer_for_a_window() {
        let mut l = FailureLimiter::default();
        let (ip, other) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for i in 1..MAX_FAILURES {
            assert!(l.allowed(ip, t0));
            assert_eq!(l.failed(ip, t0), Failure::Log, "failure {i}");
        }
        assert_eq!(l.failed(ip, t0), Failure::Blocked);
        assert!(!l.allowed(ip, t0 + FAILURE_WINDOW / 2));
        assert_eq!(l.failed(ip, t0), Failure::Quiet);
        assert!(l.allowed(other, t0));
        assert!(l.allowed(ip, t0 + FAILURE_WINDOW));
        assert_eq!(l.failed(ip, t0 + FAILURE_WINDOW), Failure::Log);
    }

    #[test]
    fn the_peer_table_stays_bounded() {
        let mut l = FailureLimiter::default();
        let t0 = Instant::now();
        for i in 0..(MAX_TRACKED_PEERS as u32 + 100) {
            l.failed(IpAddr::from(i.to_be_bytes()), t0);
        }
        assert_eq!(l.tracked(), MAX_TRACKED_PEERS);
    }
}
