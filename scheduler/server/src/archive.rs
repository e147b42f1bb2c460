//! The monthly archive of job records: `DATA/archive/YYYY-MM.jsonl`, one
//! JSON object per line ([`JobRecord`]), appended at apply when the bounded
//! `finished` table drops a job, in the month (UTC) the job finished.
//!
//! Every replica applies the same entries, so every replica writes the same
//! records in the same order. Appends are idempotent: a replica restarting
//! from a snapshot applies entries again, and a record is keyed by its job
//! id and the index of the entry that archived it. The archive remembers the
//! newest index it holds (and the jobs at that index, as one entry may drop
//! several), found again at open from the tails of the month files, and
//! skips what it already has. A torn last line (a crash mid-append) is cut
//! off at open, so its record is written again when its entry is replayed;
//! readers skip any line that does not parse. The files are synced before
//! a snapshot is built, so a snapshot never covers a record not on disk.
//!
//! Reads are bounded: a page reads at most a set number of bytes from one
//! file, from the end backwards (newest first), and says where to go on.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rota_core::state::records::{JobRecord, MAX_RECORD_LINE_BYTES};
use rota_core::state::tenancy::{month_of, month_text, parse_month, Month};
use rota_core::state::JobId;

/// Bytes read from the end of each month file at open to find the newest
/// records (lines are at most `MAX_RECORD_LINE_BYTES`; one entry drops few jobs).
const TAIL_SCAN_BYTES: u64 = 4 << 20;
/// Month files the archive looks at, at most (a century).
const MAX_MONTH_FILES: usize = 1_200;

#[derive(Debug, thiserror::Error)]
#[error("archive {path}: {source}")]
pub struct ArchiveError {
    path: String,
    source: std::io::Error,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError { path: path.display().to_string(), source }
}

/// The archive's directory in a replica's data directory.
pub fn archive_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("archive")
}

pub fn month_path(dir: &Path, month: Month) -> PathBuf {
    dir.join(format!("{}.jsonl", month_text(month)))
}

/// The months that have a file, oldest first.
pub fn months(dir: &Path) -> Vec<Month> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    let mut months: Vec<Month> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| entry.file_name().to_str()?.strip_suffix(".jsonl").and_then(|m| parse_month(m).ok()))
        .take(MAX_MONTH_FILES)
        .collect();
    months.sort_unstable();
    months
}

/// The appending side, owned by the replica's state machine.
#[derive(Debug)]
pub struct ArchiveWriter {
    dir: PathBuf,
    /// The newest archiving index written, and the jobs written at it.
    newest_index: u64,
    jobs_at_newest: BTreeSet<JobId>,
    open: Option<(Month, File)>,
    /// Files written since the last sync.
    dirty: BTreeSet<Month>,
}

impl ArchiveWriter {
    /// Open the archive under `dir` (created if missing): cut torn last
    /// lines and find the newest records it holds.
    pub fn open(dir: &Path) -> Result<ArchiveWriter, ArchiveError> {
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let mut writer =
            ArchiveWriter { dir: dir.to_path_buf(), newest_index: 0, jobs_at_newest: BTreeSet::new(), open: None, dirty: BTreeSet::new() };
        for month in months(dir) {
            let path = month_path(dir, month);
            let tail = cut_torn_line(&path)?;
            for record in tail.lines().filter_map(|line| JobRecord::from_line(line).ok()) {
                writer.note(&record);
            }
        }
        Ok(writer)
    }

    fn note(&mut self, record: &JobRecord) {
        if record.archived_index > self.newest_index {
            self.newest_index = record.archived_index;
            self.jobs_at_newest.clear();
        }
        if record.archived_index == self.newest_index {
            self.jobs_at_newest.insert(record.job_id);
        }
    }

    /// Is this record already in the archive (a replayed entry)?
    fn holds(&self, record: &JobRecord) -> bool {
        record.archived_index < self.newest_index
            || (record.archived_index == self.newest_index && self.jobs_at_newest.contains(&record.job_id))
    }

    /// Append the records of one applied entry, skipping those it holds.
    pub fn append(&mut self, records: &[JobRecord]) -> Result<usize, ArchiveError> {
        let mut written = 0;
        for record in records {
            if self.holds(record) {
                continue;
            }
            let month = month_of(record.finished_ms.unwrap_or(0));
            let path = month_path(&self.dir, month);
            if self.open.as_ref().is_none_or(|(open, _)| *open != month) {
                let file = OpenOptions::new().create(true).append(true).open(&path).map_err(io_error(&path))?;
                self.open = Some((month, file));
            }
            let (_, file) = self.open.as_mut().expect("opened above");
            let mut line = record.to_line();
            line.push('\n');
            file.write_all(line.as_bytes()).map_err(io_error(&path))?;
            self.dirty.insert(month);
            self.note(record);
            written += 1;
        }
        Ok(written)
    }

    /// Sync every file written since the last sync to disk.
    pub fn sync(&mut self) -> Result<(), ArchiveError> {
        for month in std::mem::take(&mut self.dirty) {
            let path = month_path(&self.dir, month);
            match &self.open {
                Some((open, file)) if *open == month => file.sync_all().map_err(io_error(&path))?,
                _ => File::open(&path).and_then(|f| f.sync_all()).map_err(io_error(&path))?,
            }
        }
        Ok(())
    }
}

/// Cut a file after its last newline (a torn append); the complete lines
/// of its last `TAIL_SCAN_BYTES`, as text.
fn cut_torn_line(path: &Path) -> Result<String, ArchiveError> {
    let mut file = OpenOptions::new().read(true).write(true).open(path).map_err(io_error(path))?;
    let len = file.metadata().map_err(io_error(path))?.len();
    let from = len.saturating_sub(TAIL_SCAN_BYTES);
    file.seek(SeekFrom::Start(from)).map_err(io_error(path))?;
    let mut tail = Vec::with_capacity((len - from) as usize);
    Read::by_ref(&mut file).take(TAIL_SCAN_BYTES).read_to_end(&mut tail).map_err(io_error(path))?;
    let complete = tail.iter().rposition(|b| *b == b'\n').map_or(0, |at| at + 1);
    if complete < tail.len() {
        tracing::warn!(path = %path.display(), bytes = tail.len() - complete, "cutting a torn last line of the archive");
        file.set_len(from + complete as u64).map_err(io_error(path))?;
        file.sync_all().map_err(io_error(path))?;
    }
    let mut text = String::from_utf8_lossy(&tail[..complete]).into_owned();
    if from > 0 {
        // The first line may be cut by the scan window: drop it.
        text = text.split_once('\n').map(|(_, rest)| rest.to_string()).unwrap_or_default();
    }
    Ok(text)
}

/// One page read backwards from a month file.
#[derive(Debug, Default)]
pub struct PageRead {
    /// Newest first, each with the offset just past its line (where a
    /// read that starts with it ends).
    pub records: Vec<(u64, JobRecord)>,
    /// Where the next page of this file ends (bytes from its start); 0: the
    /// file is read to its start.
    pub next_end: u64,
}

/// Read whole lines of `month`'s file that end at or before byte `end`
/// (None: its end), newest first, reading at most `max_bytes`. Lines that
/// do not parse (a torn line) are skipped.
pub fn read_back(dir: &Path, month: Month, end: Option<u64>, max_bytes: u64) -> Result<PageRead, ArchiveError> {
    let path = month_path(dir, month);
    let mut file = match File::open(&path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(PageRead::default()),
        Err(error) => return Err(io_error(&path)(error)),
    };
    let len = file.metadata().map_err(io_error(&path))?.len();
    let end = end.unwrap_or(len).min(len);
    let max_bytes = max_bytes.max(MAX_RECORD_LINE_BYTES as u64 + 1);
    let from = end.saturating_sub(max_bytes);
    file.seek(SeekFrom::Start(from)).map_err(io_error(&path))?;
    let mut chunk = Vec::with_capacity((end - from) as usize);
    file.take(end - from).read_to_end(&mut chunk).map_err(io_error(&path))?;
    // Only whole lines: from the start of the file, or after the first newline.
    let start = if from == 0 { 0 } else { chunk.iter().position(|b| *b == b'\n').map_or(chunk.len(), |at| at + 1) };
    // A last line without its newline is torn (or being written): not yet.
    let stop = chunk.iter().rposition(|b| *b == b'\n').map_or(0, |at| at + 1).max(start);
    let mut records = Vec::new();
    let mut line_start = start;
    for line in chunk[start..stop].split_inclusive(|b| *b == b'\n') {
        let line_end = from + (line_start + line.len()) as u64;
        line_start += line.len();
        if let Some(record) = std::str::from_utf8(line).ok().and_then(|text| JobRecord::from_line(text).ok()) {
            records.push((line_end, record));
        }
    }
    records.reverse();
    // A window inside one over-long line moves on past it, never stays.
    let next_end = if start == chunk.len() { from } else { from + start as u64 };
    Ok(PageRead { records, next_end })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::records::GpuSpan;
    use std::collections::BTreeMap;

    const NOV_2026: u64 = 1_793_491_200_000;
    const DEC_2026: u64 = 1_796_083_200_000;

    fn record(job_id: u64, index: u64, finished_ms: u64) -> JobRecord {
        JobRecord {
            job_id,
            archived_index: index,
            name: String::new(),
            user: String::new(),
            group: "vision".into(),
            queue: "training".into(),
            labels: BTreeMap::new(),
            template: None,
            gpus: 1,
            gpu_model: String::new(),
            nodes: vec![],
            submitted_ms: finished_ms - 10,
            started_ms: Some(finished_ms - 5),
            finished_ms: Some(finished_ms),
            state: "succeeded".into(),
            exit_code: Some(0),
            stop_reason: None,
            attempts: 1,
            preemptions: 0,
            wait_ms: Some(5),
            gpu_ms: 5,
            idle_gpu_ms: 0,
            spans: vec![GpuSpan { start_ms: finished_ms - 5, end_ms: finished_ms, gpu_ms: 5, preemptions: 0 }],
        }
    }

    fn all(dir: &Path, month: Month) -> Vec<u64> {
        read_back(dir, month, None, 1 << 20).unwrap().records.iter().map(|(_, r)| r.job_id).collect()
    }

    #[test]
    fn records_go_to_their_month_and_a_replay_writes_nothing_twice() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = ArchiveWriter::open(dir.path()).unwrap();
        assert_eq!(writer.append(&[record(1, 10, NOV_2026 + 1), record(2, 10, DEC_2026 + 1)]).unwrap(), 2);
        assert_eq!(writer.append(&[record(3, 12, DEC_2026 + 2)]).unwrap(), 1);
        writer.sync().unwrap();
        assert_eq!(months(dir.path()), vec![202_611, 202_612]);
        assert_eq!(all(dir.path(), 202_612), vec![3, 2], "newest first");
        // A restart that replays from an older snapshot.
        let mut again = ArchiveWriter::open(dir.path()).unwrap();
        assert_eq!(again.append(&[record(1, 10, NOV_2026 + 1), record(2, 10, DEC_2026 + 1)]).unwrap(), 0);
        assert_eq!(again.append(&[record(3, 12, DEC_2026 + 2), record(4, 13, DEC_2026 + 3)]).unwrap(), 1);
        assert_eq!(all(dir.path(), 202_612), vec![4, 3, 2]);
        assert_eq!(all(dir.path(), 202_611), vec![1]);
    }

    /// A crash mid-append leaves a torn line: it is skipped on read, cut at
    /// open, and the record is written again when its entry is replayed;
    /// a crash between two records of one entry writes only the missing one
    /// (without the replay check both were written again: 2, not 1).
    #[test]
    fn a_torn_last_line_is_skipped_then_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = ArchiveWriter::open(dir.path()).unwrap();
        writer.append(&[record(1, 10, DEC_2026 + 1), record(2, 11, DEC_2026 + 2)]).unwrap();
        drop(writer);
        let path = month_path(dir.path(), 202_612);
        let torn = record(3, 11, DEC_2026 + 3).to_line();
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&torn.as_bytes()[..torn.len() / 2]).unwrap();
        drop(file);
        assert_eq!(all(dir.path(), 202_612), vec![2, 1], "the torn line is not read");
        let mut writer = ArchiveWriter::open(dir.path()).unwrap();
        let replayed = [record(2, 11, DEC_2026 + 2), record(3, 11, DEC_2026 + 3)];
        assert_eq!(writer.append(&replayed).unwrap(), 1, "job 2 of entry 11 is held, job 3 is not");
        assert_eq!(all(dir.path(), 202_612), vec![3, 2, 1]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3);
        assert!(text.lines().all(|line| JobRecord::from_line(line).is_ok()));
    }

    #[test]
    fn reads_page_backwards_within_their_byte_bound() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = ArchiveWriter::open(dir.path()).unwrap();
        let records: Vec<JobRecord> = (1..=400).map(|id| record(id, id, DEC_2026 + id)).collect();
        writer.append(&records).unwrap();
        let mut seen = Vec::new();
        let mut end = None;
        for _ in 0..1_000 {
            let page = read_back(dir.path(), 202_612, end, 1).unwrap();
            assert!(!page.records.is_empty());
            assert!(page.records.len() < 400, "a page reads about its bound, not the file");
            seen.extend(page.records.iter().map(|(_, r)| r.job_id));
            if page.next_end == 0 {
                break;
            }
            end = Some(page.next_end);
        }
        assert_eq!(seen, (1..=400).rev().collect::<Vec<_>>());
    }
}
