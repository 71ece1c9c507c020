//! The parsers' tests: every command, pipelining split at every byte,
//! bad input answered with memcached's exact line, and arbitrary bytes.

use proptest::prelude::*;

use super::meta::{self, Cmd};
use super::text::{MAX_KEYS_LINE_LEN, MAX_LINE_LEN, Parsed, Request, StatsKind, Store, err, parse};
use crate::kv::Mode;
use dmkv_common::limits::MAX_VALUE_LEN;

fn one(input: &[u8]) -> Request<'_> {
    match parse(input, MAX_VALUE_LEN) {
        Parsed::Request { len, req } => {
            assert_eq!(len, input.len(), "{:?} takes all of the input", String::from_utf8_lossy(input));
            req
        }
        Parsed::Incomplete => panic!("incomplete: {:?}", String::from_utf8_lossy(input)),
    }
}

fn error_of(input: &[u8]) -> (&'static str, usize, bool) {
    match parse(input, MAX_VALUE_LEN) {
        Parsed::Request { req: Request::Error { msg, swallow, close }, .. } => (msg, swallow, close),
        other => panic!("{:?}: not an error: {other:?}", String::from_utf8_lossy(input)),
    }
}

#[test]
fn retrieval_commands() {
    assert_eq!(one(b"get a\r\n"), Request::Get { keys: vec![b"a"], cas: false, touch: None });
    assert_eq!(one(b"gets a  bb c\r\n"), Request::Get { keys: vec![b"a", b"bb", b"c"], cas: true, touch: None });
    assert_eq!(one(b"gat 10 a b\r\n"), Request::Get { keys: vec![b"a", b"b"], cas: false, touch: Some(10) });
    assert_eq!(one(b"gats -1 a\n"), Request::Get { keys: vec![b"a"], cas: true, touch: Some(-1) });
    assert_eq!(error_of(b"get\r\n").0, err::ERROR);
    assert_eq!(error_of(b"gat x a\r\n").0, err::BAD_EXPTIME);
    let long = format!("get {}\r\n", "k".repeat(251));
    assert_eq!(error_of(long.as_bytes()).0, err::BAD_FORMAT);
    assert_eq!(error_of(b"get a\x00b\r\n").0, err::BAD_FORMAT);
    // memcached takes other control bytes (memcaslap's keys have them).
    assert_eq!(one(b"get \x10\x10k\r\n"), Request::Get { keys: vec![b"\x10\x10k"], cas: false, touch: None });
}

#[test]
fn storage_commands() {
    let set = |mode, cas, noreply| {
        Request::Store(Store { mode, cas, key: b"k", flags: 5, exptime: 10, value: b"hi", noreply })
    };
    assert_eq!(one(b"set k 5 10 2\r\nhi\r\n"), set(Mode::Set, None, false));
    assert_eq!(one(b"add k 5 10 2 noreply\r\nhi\r\n"), set(Mode::Add, None, true));
    assert_eq!(one(b"replace k 5 10 2\r\nhi\r\n"), set(Mode::Replace, None, false));
    assert_eq!(one(b"append k 5 10 2\r\nhi\r\n"), set(Mode::Append, None, false));
    assert_eq!(one(b"prepend k 5 10 2\r\nhi\r\n"), set(Mode::Prepend, None, false));
    assert_eq!(one(b"cas k 5 10 2 77 noreply\r\nhi\r\n"), set(Mode::Set, Some(77), true));
    // Data with CR and LF inside is data.
    match one(b"set k 0 0 4\r\n\r\n\r\n\r\n") {
        Request::Store(s) => assert_eq!(s.value, b"\r\n\r\n"),
        other => panic!("{other:?}"),
    }
    assert_eq!(parse(b"set k 0 0 5\r\nhel", MAX_VALUE_LEN), Parsed::Incomplete);
    assert_eq!(parse(b"set k 0 0 5\r\nhello\r", MAX_VALUE_LEN), Parsed::Incomplete);
}

#[test]
fn storage_errors_and_what_they_skip() {
    // No length: nothing to skip.
    assert_eq!(error_of(b"set k 0 0\r\n"), (err::BAD_FORMAT, 0, false));
    assert_eq!(error_of(b"set k 0 0 -1\r\n"), (err::BAD_FORMAT, 0, false));
    assert_eq!(error_of(b"set k 0 0 x\r\n"), (err::BAD_FORMAT, 0, false));
    // A length: its data block is skipped.
    assert_eq!(error_of(b"set k x 0 3\r\n"), (err::BAD_FORMAT, 5, false));
    assert_eq!(error_of(b"set k 0 x 3\r\n"), (err::BAD_FORMAT, 5, false));
    assert_eq!(error_of(b"cas k 0 0 3 x\r\n"), (err::BAD_FORMAT, 5, false));
    assert_eq!(error_of(b"set k 4294967296 0 3\r\n"), (err::BAD_FORMAT, 5, false));
    let long = format!("set {} 0 0 1\r\n", "k".repeat(251));
    assert_eq!(error_of(long.as_bytes()), (err::BAD_FORMAT, 3, false));
    let big = format!("set k 0 0 {}\r\n", MAX_VALUE_LEN + 1);
    assert_eq!(error_of(big.as_bytes()), (err::TOO_LARGE, MAX_VALUE_LEN + 3, false));
    // A data block not ended by CRLF: the block is taken and refused.
    let bad = b"set k 0 0 2\r\nhiXX";
    match parse(bad, MAX_VALUE_LEN) {
        Parsed::Request { len, req: Request::Error { msg, swallow: 0, close: false } } => {
            assert_eq!((len, msg), (bad.len(), err::BAD_CHUNK))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn other_commands() {
    assert_eq!(one(b"delete k\r\n"), Request::Delete { key: b"k", noreply: false });
    assert_eq!(one(b"delete k noreply\r\n"), Request::Delete { key: b"k", noreply: true });
    assert_eq!(one(b"delete k 0\r\n"), Request::Delete { key: b"k", noreply: false });
    assert_eq!(one(b"delete k 0 noreply\r\n"), Request::Delete { key: b"k", noreply: true });
    assert_eq!(error_of(b"delete k 5\r\n").0, err::BAD_DELETE);
    assert_eq!(one(b"incr k 5\r\n"), Request::Arith { key: b"k", delta: 5, incr: true, noreply: false });
    assert_eq!(
        one(b"decr k 18446744073709551615 noreply\r\n"),
        Request::Arith { key: b"k", delta: u64::MAX, incr: false, noreply: true }
    );
    assert_eq!(error_of(b"incr k -1\r\n").0, err::BAD_DELTA);
    assert_eq!(error_of(b"incr k 18446744073709551616\r\n").0, err::BAD_DELTA);
    assert_eq!(error_of(b"incr k\r\n").0, err::ERROR);
    assert_eq!(one(b"touch k 10 noreply\r\n"), Request::Touch { key: b"k", exptime: 10, noreply: true });
    assert_eq!(error_of(b"touch k x\r\n").0, err::BAD_EXPTIME);
    assert_eq!(one(b"flush_all\r\n"), Request::FlushAll { delay: 0, noreply: false });
    assert_eq!(one(b"flush_all 30 noreply\r\n"), Request::FlushAll { delay: 30, noreply: true });
    assert_eq!(one(b"flush_all noreply\r\n"), Request::FlushAll { delay: 0, noreply: true });
    assert_eq!(error_of(b"flush_all soon\r\n").0, err::BAD_FORMAT);
    assert_eq!(one(b"version\r\n"), Request::Version);
    assert_eq!(one(b"verbosity 1\r\n"), Request::Verbosity { noreply: false });
    assert_eq!(one(b"verbosity 1 noreply\r\n"), Request::Verbosity { noreply: true });
    assert_eq!(one(b"quit\r\n"), Request::Quit);
    assert_eq!(one(b"stats\r\n"), Request::Stats(StatsKind::General));
    assert_eq!(one(b"stats slabs\r\n"), Request::Stats(StatsKind::Empty));
    assert_eq!(one(b"stats reset\r\n"), Request::Stats(StatsKind::Reset));
    assert_eq!(one(b"stats noreply\r\n"), Request::Stats(StatsKind::Unknown));
    assert_eq!(one(b"mn\r\n"), Request::MetaNoop);
    assert_eq!(error_of(b"bogus\r\n").0, err::ERROR);
    assert_eq!(error_of(b"\r\n").0, err::ERROR);
    assert_eq!(error_of(b"GET k\r\n").0, err::ERROR, "commands are case-sensitive");
}

/// Where memcached's answers were found to differ (a third-party suite's
/// findings), memcached's answers.
#[test]
fn memcacheds_answers_to_odd_requests() {
    // HTTP request lines close the connection at once.
    for req in [&b"GET / HTTP/1.0\r\n"[..], b"PUT /x HTTP/1.1\r\n", b"POST / HTTP/1.1\r\n", b"HTTP/1.1\r\n"] {
        assert!(matches!(one(req), Request::Close(_)), "{}", String::from_utf8_lossy(req));
    }
    assert_eq!(error_of(b"GET /x\r\n").0, err::ERROR, "no HTTP version: just unknown");
    // A length past an int is a bad line, not a large object.
    assert_eq!(error_of(b"set k 0 0 4294967295\r\n"), (err::BAD_FORMAT, 0, false));
    assert_eq!(error_of(b"set k 0 0 2147483647\r\n"), (err::BAD_FORMAT, 0, false));
    assert_eq!(error_of(b"set k 0 0 2147483645\r\n"), (err::TOO_LARGE, 2147483647, false));
    assert_eq!(error_of(b"set k 0 0 -1\r\n"), (err::BAD_FORMAT, 0, false));
    // stats cachedump and items, cache_memlimit.
    assert_eq!(one(b"stats cachedump 1 1\r\n"), Request::Stats(StatsKind::CacheDump { class: 1, limit: 1 }));
    assert_eq!(one(b"stats cachedump 3 0\r\n"), Request::Stats(StatsKind::CacheDump { class: 3, limit: 0 }));
    assert_eq!(error_of(b"stats cachedump 1\r\n").0, err::BAD_LINE);
    assert_eq!(error_of(b"stats cachedump 64 1\r\n").0, err::BAD_SLAB_ID);
    assert_eq!(error_of(b"stats cachedump x 1\r\n").0, err::BAD_FORMAT);
    assert_eq!(error_of(b"stats cachedump 64 x\r\n").0, err::BAD_FORMAT);
    assert_eq!(one(b"stats items\r\n"), Request::Stats(StatsKind::Items));
    assert_eq!(one(b"cache_memlimit 100\r\n"), Request::MemLimit { megabytes: 100, noreply: false });
    assert_eq!(one(b"cache_memlimit 8 noreply\r\n"), Request::MemLimit { megabytes: 8, noreply: true });
    assert_eq!(error_of(b"cache_memlimit lots\r\n").0, err::ERROR);
    assert_eq!(error_of(b"cache_memlimit\r\n").0, err::ERROR);
}

#[test]
fn long_lines_close_the_connection() {
    // As memcached: no reply, the connection closes.
    let junk = vec![b'x'; MAX_LINE_LEN + 1];
    assert!(matches!(one(&junk), Request::Close(_)));
    let set = [b"set k 0 0 1".to_vec(), vec![b' '; MAX_LINE_LEN], b"\r\n".to_vec()].concat();
    assert!(matches!(one(&set), Request::Close(_)));
    assert_eq!(parse(&junk[..MAX_LINE_LEN], MAX_VALUE_LEN), Parsed::Incomplete);
    // A get may carry many keys, up to its own bound.
    let mut get = b"get ".to_vec();
    while get.len() < MAX_LINE_LEN * 4 {
        get.extend_from_slice(b"key ");
    }
    assert_eq!(parse(&get, MAX_VALUE_LEN), Parsed::Incomplete);
    get.extend_from_slice(b"\r\n");
    assert!(matches!(one(&get), Request::Get { keys, .. } if keys.len() > 2000));
    let huge = [b"get ".to_vec(), vec![b'k'; MAX_KEYS_LINE_LEN]].concat();
    assert_eq!(error_of(&huge), (err::LINE_TOO_LONG, 0, true));
}

#[test]
fn meta_commands() {
    let Request::Meta(m) = one(b"mg foo s v t f c k O123 q\r\n") else { panic!() };
    assert_eq!((m.cmd, &*m.key, m.want_value, m.quiet), (Cmd::Get, &b"foo"[..], true, true));
    assert_eq!(m.flags.len(), 8);
    let Request::Meta(m) = one(b"mg Zm9v b k v\r\n") else { panic!() };
    assert_eq!((&*m.key, m.raw_key), (&b"foo"[..], &b"Zm9v"[..]));
    let Request::Meta(m) = one(b"ms foo 2 T90 F7 C12 MA N30 c\r\nhi\r\n") else { panic!() };
    assert_eq!(
        (m.value, m.ttl, m.client_flags, m.cas, m.mode, m.vivify),
        (&b"hi"[..], Some(90), 7, Some(12), Some(b'A'), Some(30))
    );
    let Request::Meta(m) = one(b"md foo C5 q\r\n") else { panic!() };
    assert_eq!((m.cmd, m.cas, m.quiet), (Cmd::Delete, Some(5), true));
    let Request::Meta(m) = one(b"ma foo N0 J10 D3 MD v\r\n") else { panic!() };
    assert_eq!((m.cmd, m.vivify, m.initial, m.delta, m.mode), (Cmd::Arith, Some(0), 10, 3, Some(b'D')));
    let Request::Meta(m) = one(b"ma foo\r\n") else { panic!() };
    assert_eq!((m.delta, m.mode), (1, None));
    let Request::Meta(m) = one(b"me foo\r\n") else { panic!() };
    assert_eq!(m.cmd, Cmd::Debug);
}

#[test]
fn meta_errors() {
    for (input, want) in [
        (&b"mg\r\n"[..], err::BAD_FORMAT),
        (b"mg foo v v\r\n", "CLIENT_ERROR duplicate flag"),
        (b"mg foo E5\r\n", "CLIENT_ERROR invalid flag"),
        (b"mg foo Z\r\n", "CLIENT_ERROR invalid flag"),
        (b"mg foo Tx\r\n", "CLIENT_ERROR bad token in command line format"),
        (b"mg !!! b\r\n", "CLIENT_ERROR error decoding key"),
        (b"md foo Cx\r\n", "CLIENT_ERROR bad token in command line format"),
        (b"ma foo Dx\r\n", "CLIENT_ERROR invalid numeric delta value"),
        (b"ma foo Jx\r\n", "CLIENT_ERROR invalid numeric initial value"),
        (b"ma foo MX\r\n", "CLIENT_ERROR invalid mode for ma M token"),
        (b"mg foo O012345678901234567890123456789012\r\n", "CLIENT_ERROR opaque token too long"),
        (b"mg foo a b c d e f g h i j k l m n o p q r s t u\r\n", "CLIENT_ERROR options flags are too long"),
    ] {
        assert_eq!(error_of(input), (want, 0, false), "{:?}", String::from_utf8_lossy(input));
    }
    // A refused ms skips its data block.
    assert_eq!(error_of(b"ms foo 2 MX\r\n"), ("CLIENT_ERROR invalid mode for ms M token", 4, false));
    assert_eq!(error_of(b"ms foo 2 Fx\r\n"), (err::BAD_FORMAT, 4, false));
    assert_eq!(error_of(b"ms foo x\r\n"), (err::BAD_FORMAT, 0, false));
    let big = format!("ms foo {}\r\n", MAX_VALUE_LEN + 1);
    assert_eq!(error_of(big.as_bytes()), (err::TOO_LARGE, MAX_VALUE_LEN + 3, false));
    assert!(meta::parse(b"mx", &[b"k"], None).is_err());
}

/// Parses every request of `input` in turn, as the connection does.
fn all(input: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Parsed::Request { len, req } = parse(&input[at..], MAX_VALUE_LEN) {
        assert!(len > 0);
        out.push(format!("{req:?}"));
        at += len;
    }
    out
}

#[test]
fn pipelined_requests_split_at_every_byte() {
    let stream: &[u8] = b"set a 1 0 3\r\nabc\r\nget a b\r\nincr n 2 noreply\r\nms k 2 T5\r\nxy\r\nmg k v\r\nbogus\r\ndelete a 0\r\nmn\r\n";
    let whole = all(stream);
    assert_eq!(whole.len(), 8);
    for split in 0..=stream.len() {
        // The first part, then the rest added: what a short read gives.
        let first = all(&stream[..split]);
        assert_eq!(first[..], whole[..first.len()], "split at {split}");
        let taken: usize = {
            let mut at = 0;
            while let Parsed::Request { len, .. } = parse(&stream[at..split], MAX_VALUE_LEN) {
                at += len;
            }
            at
        };
        let rest = all(&stream[taken..]);
        assert_eq!([first, rest].concat(), whole, "split at {split}");
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Parsed::Request { len, .. } = parse(&input, MAX_VALUE_LEN) {
            prop_assert!(len > 0 && len <= input.len());
        }
    }

    #[test]
    fn command_like_lines_never_panic(
        cmd in prop::sample::select(vec!["get", "gets", "gat", "set", "cas", "delete", "incr", "touch", "flush_all", "mg", "ms", "md", "ma", "me", "stats", "verbosity"]),
        args in proptest::collection::vec("[ -~]{0,12}", 0..8),
        tail in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        let input = [format!("{cmd} {}\r\n", args.join(" ")).into_bytes(), tail].concat();
        if let Parsed::Request { len, .. } = parse(&input, MAX_VALUE_LEN) {
            prop_assert!(len > 0 && len <= input.len());
        }
    }
}
