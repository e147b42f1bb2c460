//! A headless Chromium for the board's tests, driven over the Chrome
//! DevTools Protocol: a small blocking WebSocket client (text frames,
//! masked as a client must; pings answered) and the few CDP calls the
//! tests make. Chromium runs on 127.0.0.1 only, with a profile of its own
//! in a temporary directory, and is stopped by PID.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

/// How long Chromium may take to start and open its DevTools port.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a single CDP call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest WebSocket message taken (a full-page screenshot is a few MiB).
const MAX_MESSAGE_BYTES: u64 = 64 * 1024 * 1024;

/// The Chromium binary: `ROTA_CHROMIUM`, else `chromium` (the Debian
/// package) or `chromium-browser` on PATH. None where it is not installed
/// (an error under CI, which installs it: deploy/setup-debian.sh).
pub fn chromium_binary() -> Result<Option<PathBuf>> {
    if let Some(path) = std::env::var_os("ROTA_CHROMIUM") {
        return Ok(Some(PathBuf::from(path)));
    }
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
            .find(|candidate| candidate.is_file())
    });
    match found {
        Some(path) => Ok(Some(path)),
        None if std::env::var("CI").is_ok_and(|v| v == "true") => {
            bail!("chromium is not installed; CI installs it with the Debian package chromium (deploy/setup-debian.sh)")
        }
        None => {
            eprintln!("skipped: chromium is not installed (apt-get install chromium)");
            Ok(None)
        }
    }
}

/// A headless Chromium process, stopped (by PID) when dropped.
pub struct Chromium {
    child: Child,
    port: u16,
    _profile: tempfile::TempDir,
}

impl Chromium {
    /// Start `binary` headless. `--ignore-certificate-errors`: the test
    /// cluster's CA is its own, made for the test.
    pub fn start(binary: &Path) -> Result<Chromium> {
        let profile = tempfile::tempdir()?;
        let log = std::fs::File::create(profile.path().join("chromium.log"))?;
        let child = Command::new(binary)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-extensions",
                "--disable-sync",
                "--mute-audio",
                "--ignore-certificate-errors",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut chromium = Chromium { child, port: 0, _profile: profile };
        let active = chromium._profile.path().join("DevToolsActivePort");
        let started = Instant::now();
        chromium.port = loop {
            if let Some(port) = std::fs::read_to_string(&active).ok().and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok())) {
                break port;
            }
            if let Some(status) = chromium.child.try_wait()? {
                bail!("chromium exited ({status}) before opening its DevTools port: {}", chromium.log_tail());
            }
            ensure!(started.elapsed() < START_TIMEOUT, "chromium did not open its DevTools port: {}", chromium.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(chromium)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let bytes = std::fs::read(self._profile.path().join("chromium.log")).unwrap_or_default();
        String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(3_000)..]).into_owned()
    }

    /// A new tab, driven over its own DevTools WebSocket.
    pub fn new_page(&self) -> Result<Page> {
        let answer = http_request(self.port, "PUT", "/json/new?about:blank")?;
        let target: Value = serde_json::from_str(&answer).with_context(|| format!("/json/new answered {answer:?}"))?;
        let url = target["webSocketDebuggerUrl"].as_str().context("webSocketDebuggerUrl")?;
        let path =
            url.split_once("127.0.0.1:").and_then(|(_, rest)| rest.split_once('/')).map(|(_, p)| format!("/{p}")).context("ws path")?;
        let mut page = Page { socket: WebSocket::connect(self.port, &path)?, next_id: 1, console: Vec::new() };
        page.call("Page.enable", json!({}))?;
        page.call("Runtime.enable", json!({}))?;
        Ok(page)
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        // SIGTERM lets it take its child processes down with it.
        let pid = self.child.id() as libc::pid_t;
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to the DevTools port; the answer's body (read to
/// its Content-Length: the browser may keep the connection open).
fn http_request(port: u16, method: &str, path: &str) -> Result<String> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(CALL_TIMEOUT))?;
    (&stream).write_all(format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n\r\n").as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    reader.read_line(&mut status)?;
    ensure!(status.starts_with("HTTP/1.1 200"), "{method} {path}: {status}");
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        ensure!(reader.read_line(&mut line)? > 0, "{method} {path}: the answer was cut off");
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().context("Content-Length")?;
            }
        }
    }
    ensure!(length <= 1024 * 1024, "{method} {path}: a {length}-byte answer");
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body)?;
    Ok(String::from_utf8(body)?)
}

/// A page (tab) of the browser.
pub struct Page {
    socket: WebSocket,
    next_id: u64,
    /// The page's console messages and uncaught exceptions, newest last.
    console: Vec<String>,
}

/// Console lines kept per page.
const MAX_CONSOLE_LINES: usize = 200;

impl Page {
    /// Call a CDP method; its result (events in between are skipped).
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        self.socket.send_text(&json!({"id": id, "method": method, "params": params}).to_string())?;
        let deadline = Instant::now() + CALL_TIMEOUT;
        loop {
            ensure!(Instant::now() < deadline, "{method}: no answer in {CALL_TIMEOUT:?}");
            let message: Value = serde_json::from_str(&self.socket.read_text()?)?;
            if message["id"].as_u64() != Some(id) {
                self.note_console(&message);
                continue;
            }
            if let Some(error) = message.get("error") {
                bail!("{method}: {error}");
            }
            return Ok(message["result"].clone());
        }
    }

    fn note_console(&mut self, message: &Value) {
        let line = match message["method"].as_str() {
            Some("Runtime.consoleAPICalled") => {
                let args: Vec<String> = message["params"]["args"]
                    .as_array()
                    .map(|a| a.iter().map(|v| v.get("value").map_or_else(|| v["description"].to_string(), |v| v.to_string())).collect())
                    .unwrap_or_default();
                format!("console.{}: {}", message["params"]["type"].as_str().unwrap_or("log"), args.join(" "))
            }
            Some("Runtime.exceptionThrown") => format!("exception: {}", message["params"]["exceptionDetails"]),
            _ => return,
        };
        if self.console.len() == MAX_CONSOLE_LINES {
            self.console.remove(0);
        }
        self.console.push(line);
    }

    /// What the page wrote to its console, and its uncaught exceptions.
    pub fn console(&self) -> &[String] {
        &self.console
    }

    pub fn navigate(&mut self, url: &str) -> Result<()> {
        let answer = self.call("Page.navigate", json!({"url": url}))?;
        if let Some(error) = answer["errorText"].as_str() {
            bail!("navigating to {url}: {error}");
        }
        Ok(())
    }

    /// The value of a JavaScript expression (a promise is awaited).
    pub fn eval(&mut self, expression: &str) -> Result<Value> {
        let answer = self.call("Runtime.evaluate", json!({"expression": expression, "returnByValue": true, "awaitPromise": true}))?;
        if let Some(exception) = answer.get("exceptionDetails") {
            bail!("{expression}: {}", exception["exception"]["description"].as_str().unwrap_or(&exception.to_string()));
        }
        Ok(answer["result"]["value"].clone())
    }

    /// Wait until `expression` is truthy (neither null, false, 0 nor ""); its value.
    pub fn wait_for(&mut self, what: &str, expression: &str, timeout: Duration) -> Result<Value> {
        let started = Instant::now();
        let mut last = Value::Null;
        while started.elapsed() < timeout {
            // A page being replaced throws for a moment; that is not an answer.
            if let Ok(value) = self.eval(expression) {
                let truthy = match &value {
                    Value::Null => false,
                    Value::Bool(b) => *b,
                    Value::Number(n) => n.as_f64() != Some(0.0),
                    Value::String(s) => !s.is_empty(),
                    _ => true,
                };
                if truthy {
                    return Ok(value);
                }
                last = value;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("{what}: not within {timeout:?} (last: {last})")
    }

    /// A PNG of the whole page, written to `path`.
    pub fn screenshot(&mut self, path: &Path) -> Result<()> {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png", "captureBeyondViewport": true}))?;
        let data = shot["data"].as_str().context("screenshot data")?;
        std::fs::write(path, base64_decode(data)?)?;
        Ok(())
    }
}

/// A client WebSocket over plain TCP, to 127.0.0.1 only.
struct WebSocket {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl WebSocket {
    fn connect(port: u16, path: &str) -> Result<WebSocket> {
        let mut writer = TcpStream::connect(("127.0.0.1", port))?;
        writer.set_read_timeout(Some(CALL_TIMEOUT))?;
        writer.set_nodelay(true)?;
        // The key only has to be 16 bytes, base64; the server's answer is
        // not checked against it (the peer is a local browser we started).
        write!(
            writer,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: cm90YS1ib2FyZC10ZXN0IQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )?;
        let mut reader = BufReader::new(writer.try_clone()?);
        let mut status = String::new();
        reader.read_line(&mut status)?;
        ensure!(status.starts_with("HTTP/1.1 101"), "WebSocket upgrade refused: {status}");
        loop {
            let mut line = String::new();
            ensure!(reader.read_line(&mut line)? > 0, "the WebSocket handshake was cut off");
            if line == "\r\n" {
                break;
            }
        }
        Ok(WebSocket { reader, writer })
    }

    fn send_frame(&mut self, opcode: u8, payload: &[u8]) -> Result<()> {
        let mut frame = vec![0x80 | opcode];
        let len = payload.len();
        if len < 126 {
            frame.push(0x80 | len as u8);
        } else if len <= u16::MAX as usize {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(len as u64).to_be_bytes());
        }
        let mask = [0x5a, 0x17, 0xc3, 0x8e];
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.writer.write_all(&frame)?;
        Ok(())
    }

    fn send_text(&mut self, text: &str) -> Result<()> {
        self.send_frame(0x1, text.as_bytes())
    }

    /// The next whole text message (fragments joined, pings answered).
    fn read_text(&mut self) -> Result<String> {
        let mut message = Vec::new();
        loop {
            let mut head = [0u8; 2];
            self.reader.read_exact(&mut head)?;
            let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
            let masked = head[1] & 0x80 != 0;
            let len = match head[1] & 0x7f {
                126 => {
                    let mut bytes = [0u8; 2];
                    self.reader.read_exact(&mut bytes)?;
                    u64::from(u16::from_be_bytes(bytes))
                }
                127 => {
                    let mut bytes = [0u8; 8];
                    self.reader.read_exact(&mut bytes)?;
                    u64::from_be_bytes(bytes)
                }
                small => u64::from(small),
            };
            ensure!(message.len() as u64 + len <= MAX_MESSAGE_BYTES, "a WebSocket message over {MAX_MESSAGE_BYTES} bytes");
            let mut mask = [0u8; 4];
            if masked {
                self.reader.read_exact(&mut mask)?;
            }
            let mut payload = vec![0u8; len as usize];
            self.reader.read_exact(&mut payload)?;
            if masked {
                payload.iter_mut().enumerate().for_each(|(i, b)| *b ^= mask[i % 4]);
            }
            match opcode {
                0x9 => self.send_frame(0xA, &payload)?,
                0xA => {}
                0x8 => bail!("the browser closed the DevTools connection"),
                _ => {
                    message.extend_from_slice(&payload);
                    if fin {
                        return String::from_utf8(message).context("a text message");
                    }
                }
            }
        }
    }
}

/// Standard base64 (with padding), as CDP sends binary data.
fn base64_decode(text: &str) -> Result<Vec<u8>> {
    let value = |c: u8| -> Result<u32> {
        Ok(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => bail!("not base64: {:?}", c as char),
        } as u32)
    };
    let bytes: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let digits: Vec<u8> = chunk.iter().copied().filter(|c| *c != b'=').collect();
        let mut n = 0u32;
        for (i, c) in digits.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        let produced = digits.len().saturating_sub(1);
        out.extend_from_slice(&n.to_be_bytes()[1..1 + produced]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert!(base64_decode("a*==").is_err());
    }
}
