//! The replica's current snapshot, in a file of its own next to RocksDB.
//!
//! A snapshot is hundreds of megabytes at a million jobs. As a RocksDB
//! value it was copied into an encode buffer, the memtable and a table
//! file, then rewritten by compaction; as a file it is written once,
//! straight from the encoded state. The file is
//!
//! ```text
//! magic (8 bytes) | meta length (u64 LE) | meta (bincode) | data length (u64 LE) | data | SHA-256 of all before (32 bytes)
//! ```
//!
//! written under a temporary name, synced, renamed over `current` and the
//! directory synced: a crash leaves the previous snapshot in place. The
//! digest catches a disk that returns other bytes than it was given.
//! Snapshots of older versions, kept in RocksDB's `sm` column family, are
//! still read until the first snapshot written here replaces them.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use ring::digest::{Context, SHA256, SHA256_OUTPUT_LEN};

use crate::types::SnapshotMeta;

const MAGIC: &[u8; 8] = b"ROTASNP1";
const CURRENT: &str = "current";
const WRITING: &str = "current.writing";
/// A snapshot's meta is its log id and membership: small.
const MAX_META_BYTES: u64 = 16 << 20;
const WRITE_BUFFER_BYTES: usize = 1 << 20;
/// A snapshot's bytes are handed to the disk in chunks of this size as
/// they are written, rather than all at once by the final sync: on ext4
/// a log append's fsync waits for the data of other files that are being
/// flushed, so one sync of hundreds of megabytes stalls every commit for
/// as long as it takes. In chunks, an append waits for one chunk at most.
const WRITEBACK_CHUNK_BYTES: u64 = 4 << 20;

/// Name of the snapshot directory inside the RocksDB directory (RocksDB
/// leaves subdirectories it does not know alone).
pub(crate) const SNAPSHOT_DIR: &str = "snapshot";

/// Where a replica keeps its current snapshot.
#[derive(Debug, Clone)]
pub(crate) struct SnapshotFile {
    dir: PathBuf,
}

/// Why a snapshot file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SnapshotFileError {
    #[error("snapshot file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("snapshot file {path}: {what}")]
    Corrupt { path: PathBuf, what: String },
}

impl SnapshotFile {
    /// The snapshot file of the RocksDB store at `db_dir`.
    pub(crate) fn of_db(db_dir: &Path) -> SnapshotFile {
        SnapshotFile { dir: db_dir.join(SNAPSHOT_DIR) }
    }

    fn current(&self) -> PathBuf {
        self.dir.join(CURRENT)
    }

    fn io(&self, path: &Path, source: std::io::Error) -> SnapshotFileError {
        SnapshotFileError::Io { path: path.to_path_buf(), source }
    }

    /// Write `meta` and `data` as the current snapshot, durably.
    pub(crate) fn write(&self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), SnapshotFileError> {
        self.write_in_chunks(meta, data, WRITEBACK_CHUNK_BYTES)
    }

    fn write_in_chunks(&self, meta: &SnapshotMeta, data: &[u8], chunk_bytes: u64) -> Result<(), SnapshotFileError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.io(&self.dir, e))?;
        let writing = self.dir.join(WRITING);
        let meta_bytes = bincode::serialize(meta).map_err(|e| SnapshotFileError::Corrupt { path: writing.clone(), what: e.to_string() })?;
        let file = File::create(&writing).map_err(|e| self.io(&writing, e))?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER_BYTES, PacedFile::new(file, chunk_bytes));
        let mut digest = Context::new(&SHA256);
        let header = [&MAGIC[..], &(meta_bytes.len() as u64).to_le_bytes(), &meta_bytes, &(data.len() as u64).to_le_bytes()];
        for part in header.into_iter().chain([data]) {
            digest.update(part);
            out.write_all(part).map_err(|e| self.io(&writing, e))?;
        }
        out.write_all(digest.finish().as_ref()).map_err(|e| self.io(&writing, e))?;
        let file = out.into_inner().map_err(|e| self.io(&writing, e.into_error()))?.file;
        file.sync_all().map_err(|e| self.io(&writing, e))?;
        drop(file);
        let current = self.current();
        std::fs::rename(&writing, &current).map_err(|e| self.io(&current, e))?;
        File::open(&self.dir).and_then(|dir| dir.sync_all()).map_err(|e| self.io(&self.dir, e))
    }

    /// The current snapshot, its digest checked; None when none was written.
    pub(crate) fn read(&self) -> Result<Option<(SnapshotMeta, Vec<u8>)>, SnapshotFileError> {
        let path = self.current();
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io(&path, e)),
        };
        let file_len = file.metadata().map_err(|e| self.io(&path, e))?.len();
        let mut digest = Context::new(&SHA256);
        let mut magic = [0u8; 8];
        self.read_exact(&mut file, &mut magic, &mut digest)?;
        if &magic != MAGIC {
            return Err(self.corrupt("does not start with a rota snapshot's magic bytes"));
        }
        let meta_len = self.read_len(&mut file, &mut digest, MAX_META_BYTES.min(file_len))?;
        let mut meta_bytes = vec![0u8; meta_len];
        self.read_exact(&mut file, &mut meta_bytes, &mut digest)?;
        // The data is the rest of the file but for its digest: a length
        // that says otherwise is damage, not a reason to allocate it.
        let header_len = (MAGIC.len() + 8 + meta_len + 8) as u64;
        let data_room =
            file_len.checked_sub(header_len + SHA256_OUTPUT_LEN as u64).ok_or_else(|| self.corrupt("shorter than its header"))?;
        let data_len = self.read_len(&mut file, &mut digest, data_room)?;
        if data_len as u64 != data_room {
            return Err(self.corrupt(&format!("says {data_len} bytes of state, holds {data_room}")));
        }
        let mut data = vec![0u8; data_len];
        self.read_exact(&mut file, &mut data, &mut digest)?;
        let mut stored_digest = [0u8; SHA256_OUTPUT_LEN];
        file.read_exact(&mut stored_digest).map_err(|e| self.io(&path, e))?;
        if digest.finish().as_ref() != stored_digest {
            return Err(self.corrupt("its SHA-256 does not match its contents (damaged on disk)"));
        }
        let meta = bincode::deserialize(&meta_bytes).map_err(|e| self.corrupt(&format!("meta: {e}")))?;
        Ok(Some((meta, data)))
    }

    fn corrupt(&self, what: &str) -> SnapshotFileError {
        SnapshotFileError::Corrupt { path: self.current(), what: what.to_string() }
    }

    fn read_exact(&self, file: &mut File, buf: &mut [u8], digest: &mut Context) -> Result<(), SnapshotFileError> {
        file.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => self.corrupt("ends early"),
            _ => self.io(&self.current(), e),
        })?;
        digest.update(buf);
        Ok(())
    }

    fn read_len(&self, file: &mut File, digest: &mut Context, most: u64) -> Result<usize, SnapshotFileError> {
        let mut bytes = [0u8; 8];
        self.read_exact(file, &mut bytes, digest)?;
        let len = u64::from_le_bytes(bytes);
        if len > most {
            return Err(self.corrupt(&format!("a length of {len} bytes, more than the {most} it can hold")));
        }
        usize::try_from(len).map_err(|_| self.corrupt("a length past this machine's address space"))
    }
}

/// A file being written whose bytes are sent to the disk chunk by chunk
/// (see [`WRITEBACK_CHUNK_BYTES`]): at each chunk boundary the new chunk's
/// writeback starts and the one before it is waited for, so at most two
/// chunks are dirty at a time. Durability still comes from the final sync.
struct PacedFile {
    file: File,
    chunk_bytes: u64,
    written: u64,
    /// Start of the chunk whose writeback was started last.
    started_from: u64,
    /// End of that chunk.
    started_upto: u64,
}

impl PacedFile {
    fn new(file: File, chunk_bytes: u64) -> PacedFile {
        assert!(chunk_bytes > 0, "a writeback chunk holds bytes");
        PacedFile { file, chunk_bytes, written: 0, started_from: 0, started_upto: 0 }
    }

    fn start_writeback(&mut self) {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_raw_fd();
        let (new_from, new_len) = (self.started_upto, self.written - self.started_upto);
        let (old_from, old_len) = (self.started_from, self.started_upto - self.started_from);
        // SAFETY: sync_file_range on a file this struct owns; no memory is
        // handed over. Its result is not needed: it only paces the writes,
        // and a filesystem that refuses it is synced at the end as always.
        unsafe {
            libc::sync_file_range(fd, new_from as i64, new_len as i64, libc::SYNC_FILE_RANGE_WRITE);
            if old_len > 0 {
                let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
                libc::sync_file_range(fd, old_from as i64, old_len as i64, wait);
            }
        }
        self.started_from = new_from;
        self.started_upto = self.written;
        debug_assert!(self.started_from <= self.started_upto && self.started_upto == self.written);
    }
}

impl Write for PacedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.started_upto >= self.chunk_bytes {
            self.start_writeback();
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{LogId, StoredMembership};
    use openraft::CommittedLeaderId;

    fn meta(index: u64) -> SnapshotMeta {
        let log_id = LogId::new(CommittedLeaderId::new(3, 1), index);
        SnapshotMeta { last_log_id: Some(log_id), last_membership: StoredMembership::default(), snapshot_id: format!("s-{index}") }
    }

    fn state(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn a_written_snapshot_reads_back_and_a_newer_one_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        assert!(file.read().unwrap().is_none(), "none before the first write");
        file.write(&meta(10), &state(100_000, 1)).unwrap();
        file.write(&meta(20), &state(50_000, 2)).unwrap();
        let (read_meta, data) = file.read().unwrap().expect("a snapshot");
        assert_eq!(read_meta, meta(20));
        assert_eq!(data, state(50_000, 2));
    }

    #[test]
    fn a_snapshot_written_in_many_writeback_chunks_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        // 300,001 bytes in chunks of 4,096: many boundaries, the last one
        // partial, each crossed inside one buffered write.
        file.write_in_chunks(&meta(7), &state(300_001, 5), 4_096).unwrap();
        let (read_meta, data) = file.read().unwrap().expect("a snapshot");
        assert_eq!(read_meta, meta(7));
        assert_eq!(data, state(300_001, 5));
    }

    #[test]
    fn a_write_cut_off_before_its_rename_leaves_the_previous_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        file.write(&meta(10), &state(1_000, 1)).unwrap();
        std::fs::write(file.dir.join(WRITING), b"ROTASNP1 half of a newer snapshot").unwrap();
        assert_eq!(file.read().unwrap().expect("a snapshot").0, meta(10));
        file.write(&meta(30), &state(1_000, 3)).unwrap();
        assert_eq!(file.read().unwrap().expect("a snapshot").0, meta(30), "the next write goes over the leftover");
    }

    #[test]
    fn a_damaged_or_cut_snapshot_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        file.write(&meta(10), &state(10_000, 1)).unwrap();
        let path = file.current();
        let good = std::fs::read(&path).unwrap();

        let mut flipped = good.clone();
        flipped[good.len() / 2] ^= 0x40;
        std::fs::write(&path, &flipped).unwrap();
        let error = file.read().unwrap_err().to_string();
        assert!(error.contains("SHA-256") && error.contains(&path.display().to_string()), "{error}");

        std::fs::write(&path, &good[..good.len() - 100]).unwrap();
        let error = file.read().unwrap_err().to_string();
        assert!(error.contains("more than") || error.contains("early"), "{error}");

        // A length prefix damaged to claim terabytes allocates nothing.
        let mut huge = good.clone();
        let data_len_at = MAGIC.len() + 8 + bincode::serialize(&meta(10)).unwrap().len();
        huge[data_len_at..data_len_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        std::fs::write(&path, &huge).unwrap();
        let error = file.read().unwrap_err().to_string();
        assert!(error.contains("more than"), "{error}");

        std::fs::write(&path, b"not a snapshot at all, just text").unwrap();
        assert!(file.read().unwrap_err().to_string().contains("magic"));
    }
}
