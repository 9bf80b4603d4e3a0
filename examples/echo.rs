//! A bare hyper server that answers every request with the body it received:
//! the physical ceiling for one request/response on this machine, measured
//! side by side with Sluice by `benches/load/run.sh` (same hyper version, same
//! runtime settings).

use http_body_util::{BodyExt, Full};
use hyper::Response;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18081".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    // SIGTERM ends it normally (an instrumented build writes its profile at
    // exit; scripts/pgo-build.sh).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            _ = terminate.recv() => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(
                |req: hyper::Request<hyper::body::Incoming>| async move {
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let mut response = Response::new(Full::new(body));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    Ok::<_, std::convert::Infallible>(response)
                },
            );
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
