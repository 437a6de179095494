//! A minimal blocking HTTP/1.1 client over `std::net::TcpStream` for `flashplan bench` and the tests: one request
//! per connection (`Connection: close`), `Content-Length` or chunked bodies, and server-sent events read as they
//! arrive.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, writing or reading failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The response was not HTTP as expected.
    #[error("bad response: {0}")]
    Protocol(String),
    /// The URL is not `http://host:port[/path]`.
    #[error("bad url {0:?}: expected http://HOST:PORT")]
    Url(String),
}

/// A response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl Response {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// `host:port` of an `http://host:port[/...]` URL (or of a bare `host:port`).
///
/// # Errors
/// [`ClientError::Url`].
pub fn host_port(url: &str) -> Result<String, ClientError> {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let hp = rest.split('/').next().unwrap_or("");
    if hp.is_empty() || !hp.contains(':') {
        return Err(ClientError::Url(url.to_string()));
    }
    Ok(hp.to_string())
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<TcpStream, ClientError> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    Ok(s)
}

/// A reader over a response body, chunked or not.
struct Body<R: BufRead> {
    r: R,
    chunked: bool,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if !self.chunked {
            return self.r.read(buf);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.r.read_line(&mut line)?;
            if line.trim().is_empty() {
                // The CRLF after the previous chunk.
                line.clear();
                self.r.read_line(&mut line)?;
            }
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("chunk size {line:?}"),
                    )
                })?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let n = buf.len().min(self.left);
        let got = self.r.read(&mut buf[..n])?;
        if got == 0 {
            self.done = true;
        }
        self.left -= got;
        Ok(got)
    }
}

/// The status, headers and body reader of a response.
type Head = (u16, Vec<(String, String)>, Body<BufReader<TcpStream>>);

fn head(s: TcpStream) -> Result<Head, ClientError> {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ClientError::Protocol(format!("status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    Ok((
        status,
        headers,
        Body {
            r,
            chunked,
            left: 0,
            done: false,
        },
    ))
}

/// Sends a request and reads the whole response.
///
/// # Errors
/// [`ClientError`].
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Response, ClientError> {
    let s = send(addr, method, path, body)?;
    let (status, headers, mut b) = head(s)?;
    let mut bytes = Vec::new();
    b.read_to_end(&mut bytes)?;
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// Sends a request whose answer is a stream of server-sent events, calling `on_data` with each event's `data`
/// as it arrives (`[DONE]` included). A non-200 answer is returned whole without calling `on_data`.
///
/// # Errors
/// [`ClientError`].
pub fn stream_sse(
    addr: &str,
    path: &str,
    body: &str,
    mut on_data: impl FnMut(&str),
) -> Result<Response, ClientError> {
    let s = send(addr, "POST", path, Some(body))?;
    let (status, headers, b) = head(s)?;
    if status != 200 {
        let mut bytes = Vec::new();
        BufReader::new(b).read_to_end(&mut bytes)?;
        return Ok(Response {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        });
    }
    let mut r = BufReader::new(b);
    let mut line = String::new();
    let mut all = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        all.push_str(&line);
        if let Some(d) = line.trim_end_matches(['\r', '\n']).strip_prefix("data:") {
            on_data(d.strip_prefix(' ').unwrap_or(d));
        }
    }
    Ok(Response {
        status,
        headers,
        body: all,
    })
}
