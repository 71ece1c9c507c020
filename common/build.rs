fn main() {
    // A vendored protoc keeps the build free of system packages.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    prost_build::Config::new()
        .protoc_executable(protoc)
        .bytes(["."])
        // A reply is moved from the decoder through a channel to its caller:
        // boxing the rare large variants keeps every `Response` as small as
        // a GET's reply (160 bytes down to 88), so the common moves are short.
        .boxed(".dmkv.v1.Response.result.region_info")
        .boxed(".dmkv.v1.Response.result.reregister")
        .boxed(".dmkv.v1.Response.result.map")
        .compile_protos(&["proto/dmkv.proto"], &["proto"])
        .expect("compile dmkv.proto");
    println!("cargo:rerun-if-changed=proto/dmkv.proto");
}
