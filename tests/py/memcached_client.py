"""pymemcache, unmodified, against a memcached-protocol server.

Usage: memcached_client.py PORT [PORT...]

With several ports (the nodes of a dmkv cluster), pymemcache's HashClient
spreads the keys over them by its own consistent hashing, as an
application using several memcached servers does.

Run by tests/tests/memcached_client.rs against dmkvd's memcached port and
against a real memcached (which shows the expectations here are memcached's
own). Prints each check as it passes; exits 1 with a message at the first
wrong result.
"""

import sys
import time

from pymemcache.client.base import Client
from pymemcache.client.hash import HashClient
from pymemcache import serde


class RawWithFlags:
    """Stores bytes as given (flags from set(flags=...), else 0) and reads
    them back as (bytes, flags), so a test sees the flags the server kept."""

    def serialize(self, key, value):
        return value, 0

    def deserialize(self, key, value, flags):
        return value, flags


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def check(name, got, want):
    if got != want:
        fail("%s: got %r, want %r" % (name, got, want))
    print("ok   %s" % name, flush=True)


def wait_gone(c, key, limit):
    """Polls until `key` reads as a miss; how long that took. Polling
    rather than one sleep keeps the check from depending on timing."""
    start = time.monotonic()
    while c.get(key) is not None:
        if time.monotonic() - start > limit:
            fail("%s still there %.1f s after it should have expired" % (key, limit))
        time.sleep(0.05)
    return time.monotonic() - start


def client(ports, serde):
    # default_noreply=False: pymemcache otherwise sends noreply and reports
    # every store as a success, which would check nothing.
    opts = dict(serde=serde, default_noreply=False, connect_timeout=10, timeout=10)
    if len(ports) == 1:
        return Client(("127.0.0.1", ports[0]), **opts)
    return HashClient([("127.0.0.1", p) for p in ports], **opts)


def main():
    ports = [int(p) for p in sys.argv[1:]]
    c = client(ports, RawWithFlags())
    c.flush_all()

    # set / get, and flags kept as given.
    check("set", c.set("k1", b"hello", flags=0), True)
    check("get", c.get("k1"), (b"hello", 0))
    check("set with flags", c.set("k2", b"\x00binary\r\nvalue", flags=0xBEEF), True)
    check("get keeps flags", c.get("k2"), (b"\x00binary\r\nvalue", 0xBEEF))
    check("get missing", c.get("nope"), None)

    # A serializer that relies on flags: pickle_serde marks ints, strs and
    # pickles apart, so values round-trip only if flags do.
    p = client(ports, serde.pickle_serde)
    for key, value in [("p-int", 42), ("p-str", "text é"), ("p-obj", {"a": [1, 2.5, None]})]:
        check("pickle_serde set " + key, p.set(key, value), True)
        check("pickle_serde get " + key, p.get(key), value)

    # Multi-get.
    many = c.get_many(["k1", "k2", "nope"])
    check("get_many", many, {"k1": (b"hello", 0), "k2": (b"\x00binary\r\nvalue", 0xBEEF)})

    # gets + cas: a cas with the token wins; one with the old token loses.
    value, token = c.gets("k1")
    check("gets value", value, (b"hello", 0))
    check("cas with current token", c.cas("k1", b"world", token), True)
    check("get after cas", c.get("k1"), (b"world", 0))
    check("cas with old token", c.cas("k1", b"again", token), False)
    check("get after losing cas", c.get("k1"), (b"world", 0))
    check("cas on missing key", c.cas("nope", b"x", token), None)
    _, token2 = c.gets("k1")
    if token2 == token:
        fail("gets token did not change after a cas: %r" % token2)

    # incr / decr, decr stops at 0, counters on missing keys.
    check("set counter", c.set("n", b"10"), True)
    check("incr", c.incr("n", 5), 15)
    check("decr", c.decr("n", 3), 12)
    check("decr below zero", c.decr("n", 100), 0)
    check("incr from zero", c.incr("n", 7), 7)
    # memcached pads a shorter result with spaces in place ("7 "): compare
    # numbers.
    value, flags = c.get("n")
    check("get counter", (int(value), flags), (7, 0))
    check("incr missing", c.incr("nope", 1), None)

    # add / replace / append / prepend.
    check("add new", c.add("a", b"first"), True)
    check("add existing", c.add("a", b"second"), False)
    check("replace existing", c.replace("a", b"third"), True)
    check("replace missing", c.replace("nope", b"x"), False)
    check("set flags for append", c.set("ap", b"mid", flags=7), True)
    check("append", c.append("ap", b"-end"), True)
    check("prepend", c.prepend("ap", b"start-"), True)
    check("append/prepend keep flags", c.get("ap"), (b"start-mid-end", 7))
    check("append missing", c.append("nope", b"x"), False)

    # delete.
    check("delete", c.delete("a"), True)
    check("delete missing", c.delete("a"), False)
    check("get deleted", c.get("a"), None)

    # TTL: an item set with expire=1 is gone within a couple of seconds
    # (memcached's clock ticks in whole seconds, so up to ~2 s).
    check("set expire=1", c.set("ttl", b"short", expire=1), True)
    took = wait_gone(c, "ttl", 10)
    print("ok   expired after %.2f s" % took, flush=True)

    # touch extends: both items get expire=2; one is touched to 30 s. Once
    # the untouched one has expired (its old expiry has passed), the
    # touched one must still be there.
    check("set short", c.set("t-keep", b"kept", expire=2), True)
    check("set short 2", c.set("t-drop", b"dropped", expire=2), True)
    check("touch", c.touch("t-keep", expire=30), True)
    check("touch missing", c.touch("nope", expire=30), False)
    wait_gone(c, "t-drop", 10)
    time.sleep(1.2)  # and a bit more, in case t-drop's second ended early
    check("touched item survives its old expiry", c.get("t-keep"), (b"kept", 0))

    # flush_all empties the store.
    # HashClient flushes every server and returns nothing.
    check("flush_all", c.flush_all(), True if len(ports) == 1 else None)
    check("get after flush_all", c.get_many(["k1", "k2", "n", "ap", "t-keep"]), {})

    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
