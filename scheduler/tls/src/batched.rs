//! Writes that leave together: a connection whose first write after each
//! flush gives its task's turn away once.
//!
//! Over HTTP/2 every request (on a client) or response (on a server) is made
//! by its own task, which then wakes the connection's task; tokio runs a
//! task woken so right after the one that woke it, so the connection wrote
//! one message per system call while dozens were being made by tasks queued
//! behind it. Answering the first write of a batch with "pending", after
//! waking its own task, puts that task at the back of the runtime's queue:
//! the tasks ahead run first and their messages leave in the same write. A
//! lone message meets an empty queue, which is no wait.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner` whose writes give way once before each batch.
pub struct Batched<S> {
    inner: S,
    /// This batch's writes have given way already (reset by each flush).
    gave_way: bool,
}

impl<S> Batched<S> {
    pub fn new(inner: S) -> Batched<S> {
        Batched { inner, gave_way: false }
    }

    /// Pending (and woken at once) for the first write of a batch, so that
    /// the task polls again once the tasks queued before it have run.
    fn give_way(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.gave_way {
            return Poll::Ready(());
        }
        self.gave_way = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Batched<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Batched<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.give_way(cx));
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.give_way(cx));
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.inner).poll_flush(cx);
        if flushed.is_ready() {
            this.gave_way = false;
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use tokio::io::AsyncReadExt;

    use super::*;

    /// Counts its wake-ups.
    struct Wakes(AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn the_first_write_of_each_batch_gives_way_once_and_wakes_its_task() {
        let (far, near) = tokio::io::duplex(1024);
        let mut batched = Batched::new(near);
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let woken = || wakes.0.load(Ordering::SeqCst);
        for batch in [&b"first"[..], b"second"] {
            let before = woken();
            assert!(Pin::new(&mut batched).poll_write(&mut cx, batch).is_pending(), "a batch's first write gives way");
            assert_eq!(woken(), before + 1, "and asks to be polled again, or it would never be");
            assert!(matches!(Pin::new(&mut batched).poll_write(&mut cx, batch), Poll::Ready(Ok(n)) if n == batch.len()));
            let one = [io::IoSlice::new(b"+")];
            assert!(matches!(Pin::new(&mut batched).poll_write_vectored(&mut cx, &one), Poll::Ready(Ok(1))), "one turn per batch");
            assert!(Pin::new(&mut batched).poll_flush(&mut cx).is_ready());
            assert_eq!(woken(), before + 1);
        }
        drop(batched);
        let mut received = Vec::new();
        let mut far = far;
        far.read_to_end(&mut received).await.expect("read");
        assert_eq!(received, b"first+second+");
    }
}
