fn main() {
    // A vendored protoc keeps the build free of system packages.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    prost_build::Config::new()
        .protoc_executable(protoc)
        .bytes(["."])
        .compile_protos(&["proto/dmkv.proto"], &["proto"])
        .expect("compile dmkv.proto");
    println!("cargo:rerun-if-changed=proto/dmkv.proto");
}
