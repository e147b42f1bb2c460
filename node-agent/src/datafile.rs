//! Small files operators and tests put into the agent's data directory
//! (fake GPU health, XIDs, resets), read with a byte cap.

use std::path::Path;

/// Bytes read of such a file: its lines are short, and a runaway writer
/// must not make the agent hold a file of any size in memory.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// The first `max_bytes` of a file as text (a line cut at the end is
/// dropped by its parser: it does not parse).
pub fn read_capped(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(max_bytes).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}
