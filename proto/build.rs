fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // The descriptors of every service, for server reflection.
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("rota_descriptor.bin");
    tonic_prost_build::configure()
        .codec_path("crate::codec::StrictCodec")
        // A Raft message is sent again on a new connection after a transport
        // failure: shared bytes make keeping it for that a reference count.
        .bytes(".rota.raft.v1.RaftMessage.payload")
        .file_descriptor_set_path(descriptors)
        .compile_protos(&["proto/rota.proto", "proto/agent.proto", "proto/raft.proto"], &["proto"])?;
    Ok(())
}
