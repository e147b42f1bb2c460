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
//! written over a spare file (`current.writing`), synced, swapped with
//! `current` in one atomic rename and the directory synced: a crash leaves
//! the previous snapshot in place. The digest catches a disk that returns
//! other bytes than it was given, and a spare holding half a write.
//!
//! Why a spare, not a fresh file renamed over the old one: replacing the
//! old file frees hundreds of megabytes of blocks, and on a filesystem
//! that discards freed blocks (ext4 mounted `discard`) every log append's
//! sync then waits for the discard; a fresh file also allocates its blocks
//! as it is written. Measured on an ext4 volume with an 85 MB snapshot and
//! a loop of small synced appends beside it: 15-37 ms stalls per snapshot
//! written as a fresh file and renamed over the old one, at most 3 ms when
//! the spare's blocks are overwritten in place and exchanged. The price is
//! the disk space of two snapshots.
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
/// they are written, rather than all at once by the final sync: a log
/// append's sync waits for the data of other files that are being flushed,
/// so one sync of hundreds of megabytes stalls every commit for as long as
/// it takes. In chunks, an append waits for one chunk at most (with the
/// spare file of the module's note: at most 3 ms in 1 MiB chunks, 8 ms in
/// 4 MiB chunks on the volume measured there).
const WRITEBACK_CHUNK_BYTES: u64 = 1 << 20;

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
        self.write_in_chunks(meta, data, WRITEBACK_CHUNK_BYTES).map(|_chunks| ())
    }

    /// Lay a spare as large as the snapshot `meta` and `data` (written as
    /// the current one just before): for a replica that starts from a large
    /// snapshot (a restore, done before it serves). Without a spare, its
    /// first snapshot would be written into a fresh file, allocating
    /// hundreds of megabytes of blocks while the replica commits (see the
    /// module's note); with one, it overwrites blocks the file already has.
    pub(crate) fn lay_spare(&self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), SnapshotFileError> {
        self.write_spare(meta, data, WRITEBACK_CHUNK_BYTES).map(|_chunks| ())
    }

    /// Write as [`SnapshotFile::write`] does, handing the bytes to the disk
    /// in chunks of `chunk_bytes`; answers how many chunks that took.
    fn write_in_chunks(&self, meta: &SnapshotMeta, data: &[u8], chunk_bytes: u64) -> Result<u64, SnapshotFileError> {
        let chunks = self.write_spare(meta, data, chunk_bytes)?;
        let current = self.current();
        exchange_or_replace(&self.dir.join(WRITING), &current).map_err(|e| self.io(&current, e))?;
        File::open(&self.dir).and_then(|dir| dir.sync_all()).map_err(|e| self.io(&self.dir, e))?;
        Ok(chunks)
    }

    /// Write the snapshot whole into the spare file, synced, and leave it
    /// there; answers how many writeback chunks that took.
    fn write_spare(&self, meta: &SnapshotMeta, data: &[u8], chunk_bytes: u64) -> Result<u64, SnapshotFileError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.io(&self.dir, e))?;
        let writing = self.dir.join(WRITING);
        let meta_bytes = bincode::serialize(meta).map_err(|e| SnapshotFileError::Corrupt { path: writing.clone(), what: e.to_string() })?;
        // The spare is overwritten from its start, not truncated first:
        // its blocks are reused, and only a tail the new snapshot does not
        // fill is freed (by `set_len` below).
        let file = File::options().write(true).create(true).truncate(false).open(&writing).map_err(|e| self.io(&writing, e))?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER_BYTES, PacedFile::new(file, chunk_bytes));
        let mut digest = Context::new(&SHA256);
        let header = [&MAGIC[..], &(meta_bytes.len() as u64).to_le_bytes(), &meta_bytes, &(data.len() as u64).to_le_bytes()];
        for part in header.into_iter().chain([data]) {
            digest.update(part);
            out.write_all(part).map_err(|e| self.io(&writing, e))?;
        }
        out.write_all(digest.finish().as_ref()).map_err(|e| self.io(&writing, e))?;
        let mut paced = out.into_inner().map_err(|e| self.io(&writing, e.into_error()))?;
        if paced.written > paced.started_upto {
            paced.start_writeback();
        }
        let (file, written, chunks) = (paced.file, paced.written, paced.chunks_started);
        // Only a spare longer than this snapshot is cut: on ext4 a
        // truncate, even to the same length, waits for the file's dirty
        // data and holds up the journal, hence every log append's sync.
        let spare_len = file.metadata().map_err(|e| self.io(&writing, e))?.len();
        if spare_len > written {
            file.set_len(written).map_err(|e| self.io(&writing, e))?;
        }
        file.sync_all().map_err(|e| self.io(&writing, e))?;
        Ok(chunks)
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

/// Make `from` the file at `to` and keep the file that was at `to` under
/// `from` (one atomic `renameat2(RENAME_EXCHANGE)`), so the old snapshot
/// becomes the next spare and no blocks are freed. Where there is nothing
/// at `to` yet, or the filesystem cannot exchange, a plain rename.
fn exchange_or_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    if !to.exists() {
        return std::fs::rename(from, to);
    }
    let c_path = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (from_c, to_c) = (c_path(from)?, c_path(to)?);
    // SAFETY: both paths are NUL-terminated strings that outlive the call.
    let result = unsafe { libc::renameat2(libc::AT_FDCWD, from_c.as_ptr(), libc::AT_FDCWD, to_c.as_ptr(), libc::RENAME_EXCHANGE) };
    if result == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => std::fs::rename(from, to),
        _ => Err(error),
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
    /// Chunks whose writeback was started.
    chunks_started: u64,
}

impl PacedFile {
    fn new(file: File, chunk_bytes: u64) -> PacedFile {
        assert!(chunk_bytes > 0, "a writeback chunk holds bytes");
        PacedFile { file, chunk_bytes, written: 0, started_from: 0, started_upto: 0, chunks_started: 0 }
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
        self.chunks_started += 1;

        debug_assert!(self.started_from <= self.started_upto && self.started_upto == self.written);
    }
}

impl Write for PacedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Never past the chunk's end: a buffered writer hands a large slice
        // (the whole state) straight through, and written in one call it
        // would all be dirty at once, for the final sync to flush.
        let room = self.chunk_bytes - (self.written - self.started_upto);
        let n = self.file.write(&buf[..buf.len().min(room as usize)])?;
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
        let chunks = file.write_in_chunks(&meta(7), &state(300_001, 5), 4_096).unwrap();
        let file_len = std::fs::metadata(file.current()).unwrap().len();
        assert_eq!(chunks, file_len.div_ceil(4_096), "every chunk handed to the disk on its own, the last partial one too");
        let (read_meta, data) = file.read().unwrap().expect("a snapshot");
        assert_eq!(read_meta, meta(7));
        assert_eq!(data, state(300_001, 5));
    }

    #[test]
    fn each_write_reuses_the_replaced_snapshot_as_its_spare_whatever_the_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        let spare = file.dir.join(WRITING);
        let mut before: Option<Vec<u8>> = None;
        for (i, len) in [100_000usize, 50_000, 20_000, 80_000, 1_000, 120_000].into_iter().enumerate() {
            let (index, seed) = (10 * (i as u64 + 1), i as u8);
            file.write(&meta(index), &state(len, seed)).unwrap();
            let (read_meta, data) = file.read().unwrap().expect("a snapshot");
            assert_eq!((read_meta, data), (meta(index), state(len, seed)), "write {i} reads back whole");
            let header_len = MAGIC.len() + 8 + bincode::serialize(&meta(index)).unwrap().len() + 8;
            let file_len = std::fs::metadata(file.current()).unwrap().len() as usize;
            assert_eq!(file_len, header_len + len + SHA256_OUTPUT_LEN, "write {i}: no tail of a longer spare is left");
            // The snapshot replaced is kept whole as the next write's spare
            // (exchanged, not deleted: deleting frees its blocks).
            if let Some(previous) = &before {
                assert_eq!(&std::fs::read(&spare).expect("a spare after write {i}"), previous, "write {i}: the spare is the old snapshot");
            }
            before = Some(std::fs::read(file.current()).unwrap());
        }
    }

    #[test]
    fn a_spare_laid_beside_a_snapshot_is_as_long_as_it_and_takes_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::of_db(dir.path());
        let spare = file.dir.join(WRITING);
        file.write(&meta(10), &state(100_000, 1)).unwrap();
        file.lay_spare(&meta(10), &state(100_000, 1)).unwrap();
        let current_len = std::fs::metadata(file.current()).unwrap().len();
        assert_eq!(std::fs::metadata(&spare).expect("a spare").len(), current_len, "the spare is as long as the snapshot");
        assert_eq!(file.read().unwrap().expect("a snapshot"), (meta(10), state(100_000, 1)));
        // The next snapshot is written over the spare, which it fills.
        let spare_inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&spare).unwrap());
        file.write(&meta(20), &state(100_000, 2)).unwrap();
        let now_current = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(file.current()).unwrap());
        assert_eq!(now_current, spare_inode, "the spare laid beside the first snapshot became the current one");
        assert_eq!(file.read().unwrap().expect("a snapshot"), (meta(20), state(100_000, 2)));
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
