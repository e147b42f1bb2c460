fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // The descriptors of every service, for server reflection.
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("rota_descriptor.bin");
    tonic_prost_build::configure()
        .codec_path("crate::codec::StrictCodec")
        .file_descriptor_set_path(descriptors)
        .compile_protos(&["proto/rota.proto", "proto/agent.proto", "proto/raft.proto"], &["proto"])?;
    Ok(())
}
