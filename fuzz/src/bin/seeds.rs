//! Writes the seed inputs of every target into `corpus/<target>/` (run
//! from `fuzz/`): a few valid encodings of each message, so the fuzzer
//! starts from the formats rather than from nothing.

use std::path::Path;

use bytes::BytesMut;
use dmkv_common::layout::{RegionHeader, Slot, encode_item};
use dmkv_common::onesided::{self, ReadStatus, ReadWr, ReplyBuilder};
use dmkv_common::proto::{self, Request, Response, request::Op, response::Result as R};
use dmkv_common::{frame, shm_handoff};
use prost::Message;

fn requests() -> Vec<Request> {
    let b = |s: &[u8]| bytes::Bytes::copy_from_slice(s);
    let ops = vec![
        Op::Hello(proto::Hello { protocol_version: 1, client_name: "seed".into() }),
        Op::Put(proto::Put { key: b(b"key"), value: b(b"value"), ..Default::default() }),
        Op::Get(proto::Get { key: b(b"key") }),
        Op::Delete(proto::Delete { key: b(b"key"), ..Default::default() }),
        Op::MultiGet(proto::MultiGet { keys: vec![b(b"a"), b(b""), b(b"ccc")] }),
        Op::Stats(proto::Stats::default()),
        Op::RegionInfo(proto::RegionInfo {}),
        Op::Reregister(proto::Reregister {}),
        Op::RdmaConnect(proto::RdmaConnect { endpoint: b(&[1, 2, 3, 4]) }),
    ];
    ops.into_iter().enumerate().map(|(i, op)| Request { id: i as u64 + 1, op: Some(op) }).collect()
}

fn responses() -> Vec<Response> {
    let get = proto::GetReply {
        found: true,
        value: bytes::Bytes::from_static(b"v"),
        version: 9,
        hint_slot: 1 << 33 | 5,
        hint_bucket: 1,
        hint_index: 3,
    };
    let region = proto::RegionInfoReply {
        regions: vec![proto::RegionDescriptor {
            region_id: 1,
            epoch: 2,
            length: 1 << 26,
            rkey: 77,
            directory_depth: 10,
            ..Default::default()
        }],
        shm_socket: "/s".into(),
        engine_addr: "127.0.0.1:1".into(),
        host_id: "h".into(),
        rdma_device: String::new(),
        ..Default::default()
    };
    let results = vec![
        R::Error(proto::Error { code: 3, message: "e".into(), ..Default::default() }),
        R::Hello(proto::HelloReply { protocol_version: 1, server_version: "0".into(), ..Default::default() }),
        R::Put(proto::PutReply { version: 4 }),
        R::Get(get.clone()),
        R::Delete(proto::DeleteReply { existed: true }),
        R::MultiGet(proto::MultiGetReply { values: vec![get, proto::GetReply::default()] }),
        R::Stats(proto::StatsReply { counters: [("gets".to_string(), 3u64)].into_iter().collect() }),
        R::RegionInfo(Box::new(region.clone())),
        R::Reregister(Box::new(region)),
        R::RdmaConnect(proto::RdmaConnectReply {
            endpoint: bytes::Bytes::from_static(b"ep"),
            addr: 1,
            length: 2,
            rkey: 3,
            epoch: 4,
        }),
    ];
    results.into_iter().enumerate().map(|(i, r)| Response { id: i as u64, result: Some(r) }).collect()
}

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = Path::new("corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(format!("seed-{name}")), data).expect("write seed");
}

fn framed<M: Message>(ms: &[M], param: u8) -> Vec<u8> {
    let mut out = BytesMut::new();
    for m in ms {
        frame::encode(m, usize::MAX, &mut out).expect("no limit");
    }
    [&[param][..], &out[..]].concat()
}

fn main() {
    let (reqs, resps) = (requests(), responses());
    for (i, r) in reqs.iter().enumerate() {
        write("proto_request", &i.to_string(), &r.encode_to_vec());
        write("frame_request", &i.to_string(), &framed(std::slice::from_ref(r), 0));
    }
    write("frame_request", "all", &framed(&reqs, 0x07));
    write("frame_request", "small-limit", &framed(&reqs, 0x84));
    for (i, r) in resps.iter().enumerate() {
        write("proto_response", &i.to_string(), &r.encode_to_vec());
        write("frame_response", &i.to_string(), &framed(std::slice::from_ref(r), 0));
    }
    write("frame_response", "all", &framed(&resps, 0x03));

    let wrs = [ReadWr { rkey: 7, offset: 4096, len: 64 }, ReadWr { rkey: 7, offset: u64::MAX - 3, len: 8 }];
    for (name, batch) in [("none", &wrs[..0]), ("one", &wrs[..1]), ("two", &wrs[..])] {
        let mut out = BytesMut::new();
        onesided::encode_request(42, batch, &mut out);
        write("engine_request", name, &out[4..]);
        write("engine_next_frame", name, &[&[0u8][..], &out[..]].concat());
        let mut reply = BytesMut::new();
        let mut b = ReplyBuilder::new(&mut reply, 42, batch.len());
        for i in 0..batch.len() {
            let status = if i == 0 { ReadStatus::Success } else { ReadStatus::OutOfBounds };
            b.push(i, status, 5, |d| d.copy_from_slice(b"abcde"));
        }
        b.finish();
        write("engine_reply", name, &reply[4..]);
        write("engine_next_frame", &format!("reply-{name}"), &[&[0x81u8][..], &reply[..]].concat());
    }

    let mut item = Vec::new();
    encode_item(b"key", b"value", 3, 0, 0, &mut item);
    let slots: Vec<u8> = [Slot::new(1, 64, 1).pack(), 0, Slot::new(2, 128, 2).pack()]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .chain(std::iter::repeat_n(0, 40))
        .collect();
    write("item", "item", &item);
    write("item", "bucket", &slots);
    let h = RegionHeader::plan(64 << 20, 1024, 5, 1, 1_000_000).expect("plan");
    write("region_header", "header", &h.encode());

    // read_lookup: key length, key, hint selector, bucket lengths, buckets, items.
    let mut look = vec![2u8];
    look.extend_from_slice(b"key");
    look.push(0);
    look.extend_from_slice(&[0, 0, 0, 0]);
    look.extend_from_slice(&slots);
    look.extend_from_slice(&[0u8; 64]);
    look.extend_from_slice(&item);
    write("read_lookup", "miss-or-items", &look);

    write("shm_handoff", "request", &shm_handoff::encode_request(&[0u8; dmkv_common::auth::PROOF_LEN], 7, 9));
    write("shm_handoff", "reply", &shm_handoff::encode_reply(shm_handoff::STATUS_OK, 1 << 30));
}
