fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .codec_path("crate::codec::StrictCodec")
        .compile_protos(&["proto/rota.proto", "proto/agent.proto", "proto/raft.proto"], &["proto"])?;
    Ok(())
}
