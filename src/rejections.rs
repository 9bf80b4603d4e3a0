//! hyper's own answers to requests it cannot parse, given the error envelope.
//!
//! A request whose head hyper refuses (malformed, a target over its URI
//! limit, more than 100 header fields or a head over its buffer) never
//! reaches a service: hyper answers it itself, with a bare status, `connection:
//! close`, `content-length: 0` and no other header, and closes the
//! connection. So that every answer has the error envelope, the security
//! headers and a request id, the connection's writes go through [`Io`],
//! which recognises such an answer (its first header is hyper's
//! `connection: close` and it has no body, which no answer of ours has) and
//! sends a complete one in its place. Everything else passes through; the
//! check is a prefix comparison per write.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

struct Pending {
    out: Vec<u8>,
    sent: usize,
    replaces: usize,
}

/// What hyper's bare answer starts with after its status line.
const BARE: &[u8] = b"connection: close\r\ncontent-length: 0\r\n";

/// A connection's byte stream with hyper's bare refusals rewritten.
pub struct Io<T> {
    inner: T,
    /// The answer being sent in place of hyper's, how much of it is out,
    /// and the length of hyper's answer it stands for.
    pending: Option<Pending>,
}

impl<T> Io<T> {
    pub fn new(inner: T) -> Self {
        Io {
            inner,
            pending: None,
        }
    }
}

/// The envelope for hyper's status, or `None` for any other write.
fn replacement(buf: &[u8]) -> Option<Vec<u8>> {
    if !buf.starts_with(b"HTTP/1.1 4") {
        return None;
    }
    let (code, message) = match buf.get(9..12)? {
        b"400" => ("BAD_REQUEST", "the request is not valid HTTP/1.1"),
        b"414" => (
            "URI_TOO_LONG",
            "the request target is longer than the server accepts",
        ),
        b"431" => (
            "HEADERS_TOO_LARGE",
            "the request head has more than 100 header fields or is larger than about 400 KB",
        ),
        _ => return None,
    };
    let line_end = buf.windows(2).position(|w| w == b"\r\n")? + 2;
    let rest = buf[line_end..].strip_prefix(BARE)?;
    if !buf.ends_with(b"\r\n\r\n") {
        return None;
    }
    // Counted like every other error answer (`errors_total` counts each by
    // its code); the request never parsed, so method and route are unknown.
    metrics::counter!(crate::telemetry::names::ERRORS_TOTAL, "type" => code).increment(1);
    let status = std::str::from_utf8(&buf[9..12]).unwrap_or("400").to_owned();
    metrics::counter!(crate::telemetry::names::HTTP_REQUESTS_TOTAL,
        "method" => "other", "path" => "unmatched", "status" => status.clone())
    .increment(1);
    // And in the duration histogram, whose series match the counter's
    // (audit 117): as 0 s, since when the unparsed request began is not
    // known here (timing every request's first read for this rare case
    // would cost the request path a clock read).
    metrics::histogram!(crate::telemetry::names::HTTP_REQUEST_DURATION_SECONDS,
        "method" => "other", "path" => "unmatched", "status" => status)
    .record(0.0);
    let body = serde_json::json!({"error": {"code": code, "message": message}}).to_string();
    let mut out = Vec::with_capacity(buf.len() + body.len() + 320);
    out.extend_from_slice(&buf[..line_end]);
    out.extend_from_slice(b"connection: close\r\ncontent-type: application/json\r\n");
    out.extend_from_slice(
        b"x-content-type-options: nosniff\r\nx-frame-options: DENY\r\n\
          referrer-policy: no-referrer\r\n\
          content-security-policy: default-src 'none'; frame-ancestors 'none'\r\n",
    );
    out.extend_from_slice(format!("x-request-id: {}\r\n", uuid::Uuid::new_v4()).as_bytes());
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    // hyper's remaining headers (`date`) and the end of the head.
    out.extend_from_slice(rest);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

impl<T: AsyncWrite + Unpin> Io<T> {
    /// Sends what is left of the replacement answer. The record stays until
    /// the write it answers takes it (`written`): hyper retries that write
    /// with the same bytes, which must not be recognised a second time.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(p) = &mut self.pending {
            while p.sent < p.out.len() {
                let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &p.out[p.sent..]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                p.sent += n;
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Drains, then reports hyper's answer as written.
    fn written(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<io::Result<usize>> {
        ready!(self.drain(cx))?;
        let replaced = self.pending.take().map_or(0, |p| p.replaces);
        Poll::Ready(Ok(replaced.min(len)))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Io<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Io<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.pending.is_none() {
            match replacement(buf) {
                Some(out) => {
                    this.pending = Some(Pending {
                        out,
                        sent: 0,
                        replaces: buf.len(),
                    })
                }
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        // hyper's answer counts as written once ours is (anything hyper
        // queued after it is left to the next call).
        this.written(cx, buf.len())
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.pending.is_none() {
            let first = bufs.iter().find(|b| !b.is_empty());
            // A bare answer is one piece (a head without a body).
            let single = bufs.iter().filter(|b| !b.is_empty()).count() == 1;
            match first.filter(|_| single).and_then(|head| replacement(head)) {
                Some(out) => {
                    this.pending = Some(Pending {
                        out,
                        sent: 0,
                        replaces: first.map_or(0, |b| b.len()),
                    })
                }
                None => return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs),
            }
        }
        this.written(cx, bufs.iter().map(|b| b.len()).sum())
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Through a pipe that takes 16 bytes at a time: the answer goes out
    /// whole and once, though the write that carries it is retried many
    /// times, and hyper's bytes count as written.
    #[tokio::test]
    async fn the_replacement_survives_partial_writes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bare: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\
                            content-length: 0\r\ndate: x\r\n\r\n";
        let (near, mut far) = tokio::io::duplex(16);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut io = Io::new(near);
        io.write_all(bare).await.unwrap();
        io.write_all(b"after").await.unwrap();
        io.shutdown().await.unwrap();
        drop(io);
        let got = String::from_utf8(reader.await.unwrap()).unwrap();
        assert_eq!(got.matches("HTTP/1.1 400").count(), 1, "{got}");
        assert!(got.contains("\"code\":\"BAD_REQUEST\""), "{got}");
        assert!(got.ends_with("}after"), "{got}");
    }

    #[test]
    fn only_hypers_bare_answers_are_replaced() {
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n\
                     content-length: 0\r\ndate: Thu, 26 Nov 2026 11:46:22 GMT\r\n\r\n";
        let out = String::from_utf8(replacement(bare).unwrap()).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(
            head.contains("\r\nx-content-type-options: nosniff\r\n"),
            "{head}"
        );
        assert!(
            head.contains("\r\ndate: Thu, 26 Nov 2026 11:46:22 GMT"),
            "{head}"
        );
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "HEADERS_TOO_LARGE");

        // An answer of ours (headers first, a body), another status, a
        // partial head: passed through.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"[..],
            b"HTTP/1.1 405 Method Not Allowed\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n",
            b"HTTP/1.1 200 OK\r\n",
            b"HTTP/1.1 4",
        ] {
            assert!(replacement(other).is_none());
        }
    }
}
