//! Which log and snapshot formats this replica reads (see
//! `rota_core::state::codec`): a leaf every module may ask.

use std::sync::OnceLock;

use rota_core::state::codec;

/// The newest format this replica reads: its build's, or lower under the
/// TEST ONLY switch `ROTA_TEST_FORMAT_VERSION`, which makes a replica read
/// (and say it reads) only up to that format, as an older build would. The
/// upgrade tests use it to stand for a replica not yet upgraded.
pub fn readable_format() -> u16 {
    static READABLE: OnceLock<u16> = OnceLock::new();
    *READABLE.get_or_init(|| {
        let forced = std::env::var("ROTA_TEST_FORMAT_VERSION").ok().and_then(|v| v.parse::<u16>().ok());
        match forced {
            Some(version) => {
                let version = version.clamp(codec::FIRST_FORMAT_VERSION, codec::FORMAT_VERSION);
                tracing::error!(
                    version,
                    "ROTA_TEST_FORMAT_VERSION: this replica reads formats up to {version} only; never use this outside tests"
                );
                version
            }
            None => codec::FORMAT_VERSION,
        }
    })
}
