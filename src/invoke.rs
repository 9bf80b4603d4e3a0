//! `channel_call`: the runtime's [`ChannelInvoker`], in-process. The callee is
//! looked up by name in the live snapshot and runs with its own governance
//! (dedup, rate limit, validation, backpressure, cache), its own versioning
//! and its own timeout; cycles and calls deeper than
//! `engine.max_channel_call_depth` are task errors that name the chain.

use crate::app::App;
use crate::governance::{Stage, View};
use async_trait::async_trait;
use sluice_runtime::connectors::{
    CallScope, CalleeError, ChannelInvoker, ConnectorError, ConnectorErrorKind, InvokeRequest,
    Invoked,
};
use sluice_runtime::exec::{self, FailureKind, Input, Meta, Options, PayloadFrom, Status};
use std::sync::{OnceLock, Weak};
use std::time::{Duration, Instant};

/// The invoker needs the `App` (snapshot, governance, services), which owns
/// it through `Services`: a `Weak` set once by [`attach`] breaks the cycle.
#[derive(Default)]
pub struct Invoker {
    app: OnceLock<Weak<App>>,
}

impl Invoker {
    pub fn attach(&self, app: &std::sync::Arc<App>) {
        let _ = self.app.set(std::sync::Arc::downgrade(app));
    }
}

/// Wires `channel_call` to this app (called once by `sluice::start`).
pub fn attach(app: &std::sync::Arc<App>) {
    app.invoker.attach(app);
}

/// At most the first 64 characters of a name for a message, and how long
/// it was when it is longer.
fn excerpt(name: &str) -> std::borrow::Cow<'_, str> {
    match name.char_indices().nth(64) {
        None => name.into(),
        Some((end, _)) => format!("{}… ({} bytes)", &name[..end], name.len()).into(),
    }
}

/// The runtime prefixes the function's name (`channel_call: …`).
fn task_error(message: String) -> ConnectorError {
    ConnectorError::other(message)
}

#[async_trait]
impl ChannelInvoker for Invoker {
    async fn invoke(
        &self,
        scope: &CallScope,
        req: InvokeRequest,
    ) -> Result<Invoked, ConnectorError> {
        let app = self
            .app
            .get()
            .and_then(Weak::upgrade)
            .ok_or_else(|| task_error("the service is shutting down".into()))?;
        // The chain so far, outermost first; a scope built without one (an
        // older caller) still counts its own channel.
        let mut chain = if scope.chain.is_empty() && !scope.channel.is_empty() {
            vec![scope.channel.clone()]
        } else {
            scope.chain.clone()
        };
        let cycle = chain.contains(&req.channel);
        chain.push(req.channel.clone());
        // Names come from the caller's data: messages quote at most the
        // first 64 characters of each.
        let named = chain
            .iter()
            .map(|c| excerpt(c))
            .collect::<Vec<_>>()
            .join(" -> ");
        let callee = excerpt(&req.channel);
        if cycle {
            return Err(task_error(format!("cycle: {named}")));
        }
        let max = app.config.engine.max_channel_call_depth as usize;
        if chain.len() - 1 > max {
            return Err(task_error(format!(
                "depth {} exceeds engine.max_channel_call_depth ({max}): {named}",
                chain.len() - 1
            )));
        }
        let snapshot = app.engine.load_full();
        let channel = snapshot
            .channels
            .get(&req.channel)
            .ok_or_else(|| task_error(format!("channel '{callee}' not found ({named})")))?;
        let body = serde_json::to_vec(&req.data).unwrap_or_else(|_| b"null".to_vec());
        // Outside clients are identified by IP; a caller channel is its own
        // client, so a callee's rate limit meters each calling channel.
        let client = format!("channel:{}", scope.channel);
        // The caller's request id, so the callee's log lines and its
        // `metadata.request_id` name the same request.
        let request_id = req
            .request_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let headers = [("x-request-id", request_id.as_str())];
        let view = View {
            client_ip: &client,
            method: "POST",
            target: &channel.name,
            headers: &[],
            query: &[],
            path: &[],
            body: &body,
            internal: true,
            bucket: req.bucket,
            profile: false,
        };
        let refused = |e: crate::api::ApiError| {
            let kind = match e.code {
                crate::api::Code::Timeout => ConnectorErrorKind::Timeout,
                _ => ConnectorErrorKind::Other,
            };
            ConnectorError::new(
                kind,
                format!(
                    "channel '{callee}' answered {} {}: {} ({named})",
                    e.code.status().as_u16(),
                    e.code.as_str(),
                    e.message
                ),
            )
        };
        let admitted = app
            .governance
            .admit(channel, &view, Stage::Run)
            .await
            .map_err(refused)?;
        if let Some(hit) = &admitted.hit {
            let data = serde_json::from_slice(hit)
                .map_err(|e| task_error(format!("bad cached response: {e}")))?;
            return Ok(Invoked {
                data,
                errors: Vec::new(),
            });
        }
        let timeout = req
            .timeout_ms
            .map_or(channel.timeout, Duration::from_millis);
        let input = Input {
            body: &body,
            payload_from: PayloadFrom::Whole,
            meta: Meta {
                headers: &headers,
                query: &[],
                path: &[],
                method: "POST",
                channel: &channel.name,
                request_id: &request_id,
                extra: &[],
            },
            bucket: req.bucket,
        };
        let options = Options {
            deadline: Some(Instant::now() + timeout),
            timer: Some(crate::data::deadline_timer),
            ..Options::default()
        };
        let callee_scope = CallScope {
            channel: channel.name.clone(),
            traceparent: scope.traceparent.clone(),
            tracestate: scope.tracestate.clone(),
            chain,
            // The caller's span recorder: the callee's connector calls are
            // spans of the same request.
            observer: scope.observer.clone(),
        };
        channel.metrics.executions.increment(1);
        let run = exec::execute(
            channel.plans.iter().map(|p| &**p),
            input,
            &app.services,
            &callee_scope,
            &options,
        );
        let execution = match tokio::time::timeout(timeout + crate::data::DEADLINE_GRACE, run).await
        {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                // The body was refused: nothing ran, the deduplication key
                // goes back (as on the data plane).
                app.governance.give_back(&admitted).await;
                return Err(task_error(format!("{e} ({named})")));
            }
            Err(_) => {
                return Err(ConnectorError::new(
                    ConnectorErrorKind::Timeout,
                    format!(
                        "channel '{callee}' did not finish within {} ms ({named})",
                        timeout.as_millis()
                    ),
                ));
            }
        };
        if execution.matched.is_none() {
            app.governance.give_back(&admitted).await;
            let why = execution
                .errors
                .first()
                .map_or(String::new(), |e| format!(": {}", e.message));
            return Err(task_error(format!(
                "no active workflow of channel '{callee}' matches ({named}){why}"
            )));
        }
        if let Status::Failed(f) = &execution.status {
            if f.kind == FailureKind::Timeout {
                // The callee ran into this call's deadline (the executor
                // stopped it there, naming its task).
                return Err(ConnectorError::new(
                    ConnectorErrorKind::Timeout,
                    format!(
                        "channel '{callee}' did not finish within {} ms; its task '{}' was running ({named})",
                        timeout.as_millis(),
                        f.task_id
                    ),
                ));
            }
            let kind = match f.kind {
                FailureKind::Timeout => ConnectorErrorKind::Timeout,
                FailureKind::CircuitOpen => ConnectorErrorKind::CircuitOpen,
                FailureKind::Upstream => ConnectorErrorKind::Upstream,
                FailureKind::Task | FailureKind::Validation => ConnectorErrorKind::Other,
            };
            // A failure from further down the chain already names the
            // failing channel, its task and the whole chain (which holds
            // this one): it goes up as it is, not wrapped once per level
            // (the runtime puts its `channel_call: ` back on).
            if f.message.contains(&named) {
                let inner = f
                    .message
                    .strip_prefix("channel_call: ")
                    .unwrap_or(&f.message);
                return Err(ConnectorError::new(kind, inner.to_owned()));
            }
            return Err(ConnectorError::new(
                kind,
                format!(
                    "channel '{callee}': task '{}' failed: {} ({named})",
                    f.task_id, f.message
                ),
            ));
        }
        // Only an answer without errors is cached: a hit carries no errors.
        if execution.errors.is_empty() {
            app.governance
                .store(&admitted, bytes::Bytes::from(execution.data.clone()))
                .await;
        }
        let data = serde_json::from_slice(&execution.data)
            .map_err(|e| task_error(format!("the callee's data is not JSON: {e}")))?;
        Ok(Invoked {
            data,
            errors: execution
                .errors
                .into_iter()
                .map(|e| CalleeError {
                    code: e.code.to_owned(),
                    task_id: e.task_id,
                    message: e.message,
                })
                .collect(),
        })
    }
}
