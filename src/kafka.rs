//! Kafka-consuming channels: one consumer per (channel, topic, group), each
//! message run through the channel's workflow, at least once.
//!
//! - **Which consumers run** follows the engine: after every reload the
//!   supervisor compares the active Kafka channels (and `kafka.topics` from
//!   the config file) with the running consumers, stops those no longer
//!   wanted and starts the new ones. A new workflow version for a channel
//!   does not restart its consumer: each message runs on the snapshot current
//!   when it starts.
//! - **Order and backpressure:** messages of one partition run one after the
//!   other, in offset order, on that partition's lane; partitions run side by
//!   side. At most `kafka.max_in_flight` messages per consumer are fetched
//!   and not yet finished; fetching waits for room.
//! - **At-least-once:** a lane stores a message's offset
//!   (`enable.auto.offset.store=false`) only after its run finished and its
//!   trace was recorded (completed; or failed and dead-lettered); the stored
//!   offsets are committed every `kafka.commit_interval_ms` by the consumer
//!   itself (librdkafka's auto-commit is off, so nothing else commits).
//!   Stopping a consumer lets running messages finish, skips queued ones
//!   (they are redelivered) and commits synchronously what finished. A killed
//!   process loses no committed work and reruns what it had not committed.
//! - **A lane never gives up on a message:** recording its trace, creating
//!   the dead-letter producer and publishing the dead letter are retried with
//!   backoff until they succeed or the consumer stops (then the message is
//!   left uncommitted and redelivered); a panic in a run is a failed run. A
//!   lane ends only when its consumer stops, so no partition stalls or skips
//!   messages behind a lane that is gone. A partition held this way keeps
//!   its queued messages (and their room in `max_in_flight`): an outage
//!   long enough slows the whole consumer down rather than losing anything.
//! - **Rebalances** (replicas joining or leaving the group): before a
//!   partition is revoked, its queued messages are dropped (the new owner
//!   reads them from the committed offset), the one running is let finish
//!   (bounded by half the session timeout) and what finished is committed
//!   synchronously, so the new owner neither loses nor repeats work.
//! - **Each message** becomes a trace with `mode: kafka` (stored once, in its
//!   final state). The value is the payload: `{"data": ...}` or any other JSON
//!   value as a whole. Its key, topic, partition and offset are `metadata.key`
//!   (absent when the message has none), `metadata.topic`,
//!   `metadata.partition` and `metadata.offset` (strings), its headers
//!   `metadata.headers` (names lowercased); `traceparent`/`tracestate` headers
//!   continue the producer's trace.
//! - **Failures:** with `kafka.dlq.enabled`, a failed message (and a value
//!   that is not JSON) is published to `kafka.dlq.topic` as `{trace_id,
//!   channel, source_topic, partition, offset, key, error: {code, task_id,
//!   message}, payload, failed_at}`, with the message's own headers, before its offset is
//!   stored. Without the DLQ topic, a failed trace gets a dead-letter entry
//!   in storage and is retried like a failed async trace. A value that is
//!   not JSON, or nests deeper than the trace store keeps, is refused
//!   before it runs and never retried.

use crate::app::App;
use crate::storage::{NewTrace, Outcome};
use rdkafka::ClientContext;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Headers as _, Message as _, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Map, Value as Json, json};
use sluice_compiler::def::Protocol;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;

/// What one consumer reads and for which channel.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subscription {
    pub channel: String,
    pub topic: String,
    pub group: String,
}

/// The supervisor's handles; lives in `App`.
pub struct Consumers {
    changed: watch::Sender<u64>,
    stop: watch::Sender<bool>,
    supervisor: Mutex<Option<JoinHandle<()>>>,
    /// Subscriptions consuming now (for `GET /engine/status` and tests).
    running: Mutex<BTreeSet<Subscription>>,
    dlq: tokio::sync::OnceCell<FutureProducer>,
}

impl Default for Consumers {
    fn default() -> Self {
        Consumers {
            changed: watch::channel(0).0,
            stop: watch::channel(false).0,
            supervisor: Mutex::new(None),
            running: Mutex::new(BTreeSet::new()),
            dlq: tokio::sync::OnceCell::new(),
        }
    }
}

impl std::fmt::Debug for Consumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumers")
            .field("running", &*lock(&self.running))
            .finish()
    }
}

impl Consumers {
    /// Tells the supervisor the engine changed (after every reload).
    pub fn engine_changed(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    /// The subscriptions consuming now.
    pub fn running(&self) -> Vec<Subscription> {
        lock(&self.running).iter().cloned().collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts the supervisor when `kafka.enabled` (once).
pub fn start(app: &Arc<App>) {
    if !app.config.kafka.enabled {
        let kafka_channels = desired(app).len();
        if kafka_channels > 0 {
            tracing::warn!(
                kafka_channels,
                "Kafka channels are active but kafka.enabled is false; nothing is consumed"
            );
        }
        return;
    }
    let mut slot = lock(&app.kafka.supervisor);
    if slot.is_none() {
        *slot = Some(tokio::spawn(supervise(
            app.clone(),
            app.kafka.changed.subscribe(),
            app.kafka.stop.subscribe(),
        )));
    }
}

/// Stops every consumer: running messages may finish within `drain`, then
/// what finished is committed.
pub async fn shutdown(app: &App, drain: Duration) {
    let _ = app.kafka.stop.send(true);
    let handle = lock(&app.kafka.supervisor).take();
    if let Some(mut handle) = handle
        && tokio::time::timeout(drain + Duration::from_secs(5), &mut handle)
            .await
            .is_err()
    {
        tracing::warn!(
            "Kafka consumers did not stop in time; uncommitted messages are redelivered"
        );
        handle.abort();
    }
}

/// The subscriptions the current engine and config ask for.
fn desired(app: &App) -> BTreeSet<Subscription> {
    let snapshot = app.engine.load();
    let k = &app.config.kafka;
    let mut out = BTreeSet::new();
    for channel in snapshot.channels.values() {
        if channel.def.protocol() != Protocol::Kafka {
            continue;
        }
        // A channel with no active workflow is held as a paused one is: its
        // messages wait in the topic (consuming them would fail each one
        // with "no active workflow" and commit it).
        if channel.plans.is_empty() {
            continue;
        }
        let cfg = &channel.def.config_json;
        let Some(topic) = cfg.topic.clone() else {
            continue;
        };
        out.insert(Subscription {
            channel: channel.name.clone(),
            topic,
            group: cfg
                .consumer_group
                .clone()
                .unwrap_or_else(|| k.group_id.clone()),
        });
    }
    for t in &k.topics {
        match snapshot.channels.get(&t.channel) {
            Some(channel) if channel.plans.is_empty() => tracing::info!(
                topic = %t.topic,
                channel = %t.channel,
                "kafka.topics names a channel with no active workflow; the topic waits"
            ),
            Some(channel) => {
                out.insert(Subscription {
                    channel: channel.name.clone(),
                    topic: t.topic.clone(),
                    group: channel
                        .def
                        .config_json
                        .consumer_group
                        .clone()
                        .unwrap_or_else(|| k.group_id.clone()),
                });
            }
            None => tracing::warn!(
                topic = %t.topic,
                channel = %t.channel,
                "kafka.topics names a channel that is not active; the topic is not consumed"
            ),
        }
    }
    out
}

/// What a channel definition would consume once active: `(topic, group)`
/// for its own topic (a Kafka channel) and for each `kafka.topics` entry
/// that names it, in its `consumer_group`, else `kafka.group_id`.
pub fn consumes(app: &App, def: &serde_json::Value) -> Vec<(String, String)> {
    let cfg = def.get("config_json");
    let group = cfg
        .and_then(|c| c.get("consumer_group"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or(&app.config.kafka.group_id);
    let mut topics: Vec<&str> = Vec::new();
    if def.get("protocol").and_then(serde_json::Value::as_str) == Some("kafka")
        && let Some(topic) = cfg
            .and_then(|c| c.get("topic"))
            .and_then(serde_json::Value::as_str)
    {
        topics.push(topic);
    }
    let name = def.get("name").and_then(serde_json::Value::as_str);
    topics.extend(
        app.config
            .kafka
            .topics
            .iter()
            .filter(|t| Some(t.channel.as_str()) == name)
            .map(|t| t.topic.as_str()),
    );
    topics
        .into_iter()
        .map(|t| (t.to_string(), group.to_string()))
        .collect()
}

/// Why a channel (its stored definition `def`) may not be activated:
/// another active channel (`others`, the other ids' active versions as
/// stored, read in the activation's transaction) already consumes one of
/// its topics in the same consumer group, and the two would split the
/// topic's partitions between them, each running only part of the
/// messages. `None` when it consumes nothing or shares no group.
pub fn shared_group(
    app: &App,
    def: &serde_json::Value,
    others: &[crate::storage::StoredRecord],
) -> Option<String> {
    let mine = consumes(app, def);
    if mine.is_empty() {
        return None;
    }
    others.iter().find_map(|other| {
        let theirs: serde_json::Value = serde_json::from_str(&other.text).ok()?;
        let (topic, group) = consumes(app, &theirs).into_iter().find(|s| mine.contains(s))?;
        let name = theirs.get("name").and_then(serde_json::Value::as_str).unwrap_or(&other.id);
        Some(format!(
            "channel '{name}' already consumes topic '{topic}' in consumer group '{group}': two channels in one group split the topic's partitions, each running part of the messages; give this channel its own config_json.consumer_group"
        ))
    })
}

struct Running {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
}

async fn supervise(
    app: Arc<App>,
    mut changed: watch::Receiver<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let mut running: HashMap<Subscription, Running> = HashMap::new();
    loop {
        let want = desired(&app);
        // Activation refuses this, but a changed `kafka.group_id` or
        // `kafka.topics` at start-up can bring two channels into one group
        // (audit 74): said once per reconcile, as it splits the topic.
        let mut seen: HashMap<(&str, &str), &str> = HashMap::new();
        for s in &want {
            if let Some(first) = seen.insert((&s.topic, &s.group), &s.channel) {
                tracing::warn!(topic = %s.topic, group = %s.group, channels = %format!("{first}, {}", s.channel),
                    "two channels consume one topic in one consumer group: each runs only part of its messages; give one its own consumer_group");
            }
        }
        let gone: Vec<Subscription> = running
            .keys()
            .filter(|s| !want.contains(*s))
            .cloned()
            .collect();
        let stopping = gone.into_iter().filter_map(|s| {
            tracing::info!(channel = %s.channel, topic = %s.topic, group = %s.group, "stopping Kafka consumer");
            running.remove(&s).map(stop_consumer)
        });
        futures_util::future::join_all(stopping).await;
        for s in want {
            if running.contains_key(&s) {
                continue;
            }
            tracing::info!(channel = %s.channel, topic = %s.topic, group = %s.group, "starting Kafka consumer");
            let (tx, rx) = watch::channel(false);
            let handle = tokio::spawn(consume(app.clone(), s.clone(), rx));
            running.insert(s, Running { stop: tx, handle });
        }
        *lock(&app.kafka.running) = running.keys().cloned().collect();
        tokio::select! {
            r = changed.changed() => if r.is_err() { break },
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    futures_util::future::join_all(running.into_values().map(stop_consumer)).await;
    lock(&app.kafka.running).clear();
}

async fn stop_consumer(r: Running) {
    let _ = r.stop.send(true);
    let _ = r.handle.await;
}

/// What the lanes of one consumer and its rebalance callback share.
#[derive(Default)]
struct Partitions {
    state: Mutex<PartitionState>,
    /// Signalled whenever a lane finishes a message.
    idle: std::sync::Condvar,
}

#[derive(Default)]
struct PartitionState {
    /// Per partition, the offset after the last message that finished: what
    /// to commit.
    finished: HashMap<i32, i64>,
    /// Per partition, bumped on every revocation: a message fetched under an
    /// older epoch belongs to a previous ownership and is not run.
    epoch: HashMap<i32, u64>,
    /// Partitions with a message running now.
    busy: HashSet<i32>,
    /// Revoked partitions whose running message the rebalance callback is
    /// waiting for: that message still counts (and is committed).
    draining: HashSet<i32>,
}

impl PartitionState {
    /// Whether a message of `partition` fetched under `epoch` may still be
    /// committed.
    fn owns(&self, partition: i32, epoch: u64) -> bool {
        self.epoch.get(&partition).copied().unwrap_or(0) == epoch
            || self.draining.contains(&partition)
    }
}

impl Partitions {
    fn epoch(&self, partition: i32) -> u64 {
        lock(&self.state)
            .epoch
            .get(&partition)
            .copied()
            .unwrap_or(0)
    }
}

type Kafka = StreamConsumer<Rebalancer>;

/// The consumer context: runs before librdkafka gives partitions away.
struct Rebalancer {
    topic: String,
    partitions: Arc<Partitions>,
    /// Longest wait for a running message of a revoked partition.
    drain: Duration,
    /// The client's own log lines, throttled.
    log: crate::connectors::kafka::QuietLog,
}

impl ClientContext for Rebalancer {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log_line(level, fac, log_message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.log.error_line(&error, reason);
    }
}

impl ConsumerContext for Rebalancer {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(revoked) = rebalance else {
            return;
        };
        let ids: Vec<i32> = revoked
            .elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        if ids.is_empty() {
            return;
        }
        let settle = || {
            let mut st = lock(&self.partitions.state);
            for p in &ids {
                *st.epoch.entry(*p).or_default() += 1;
                st.draining.insert(*p);
            }
            let deadline = Instant::now() + self.drain;
            while ids.iter().any(|p| st.busy.contains(p)) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    tracing::warn!(topic = %self.topic, "a message still running on a revoked partition; its new owner runs it again");
                    break;
                }
                st = self
                    .partitions
                    .idle
                    .wait_timeout(st, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
            let mut commit = TopicPartitionList::new();
            for p in &ids {
                st.draining.remove(p);
                if let Some(next) = st.finished.remove(p) {
                    let _ = commit.add_partition_offset(&self.topic, *p, Offset::Offset(next));
                }
            }
            commit
        };
        // This runs inside the consumer's `recv` on a runtime worker; lanes
        // are other tasks, so hand this worker's queue to another thread
        // while waiting for them.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let commit = if multi_thread {
            tokio::task::block_in_place(settle)
        } else {
            settle()
        };
        if commit.count() > 0 {
            match consumer.commit(&commit, CommitMode::Sync) {
                Ok(()) => {
                    tracing::info!(topic = %self.topic, partitions = ?ids, "committed finished messages of revoked partitions")
                }
                Err(e) => {
                    tracing::warn!(topic = %self.topic, error = %e, "commit on revocation failed; finished messages may be redelivered")
                }
            }
        }
    }
}

/// A fetched message waiting on its partition's lane.
type Queued = (OwnedMessage, u64, OwnedSemaphorePermit);

/// One consumer; returns when `stop` is set (after committing).
async fn consume(app: Arc<App>, sub: Subscription, stop: watch::Receiver<bool>) {
    while consume_once(&app, &sub, stop.clone()).await {
        let mut stop = stop.clone();
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// One consumer's loop, until `stop` is set (after committing); `true` when
/// it must start over instead (a lane was lost).
async fn consume_once(app: &Arc<App>, sub: &Subscription, mut stop: watch::Receiver<bool>) -> bool {
    let k = &app.config.kafka;
    let partitions = Arc::new(Partitions::default());
    let consumer: Arc<Kafka> = loop {
        let mut cfg = crate::connectors::kafka::client_config(&k.brokers, None, None);
        // Commits are ours alone (see `commit_stored`): with librdkafka's
        // auto-commit on, closing the consumer would commit too.
        cfg.set("group.id", &sub.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", k.session_timeout_ms.to_string())
            .set("queued.max.messages.kbytes", "16384")
            // A topic that does not exist yet is picked up within seconds
            // (librdkafka's default re-checks every 5 minutes).
            .set("allow.auto.create.topics", "true")
            .set("topic.metadata.refresh.interval.ms", "5000");
        let context = Rebalancer {
            topic: sub.topic.clone(),
            partitions: partitions.clone(),
            drain: Duration::from_millis(k.session_timeout_ms / 2),
            log: crate::connectors::kafka::QuietLog::new(format!("topic '{}'", sub.topic)),
        };
        match cfg.create_with_context::<_, Kafka>(context) {
            Ok(c) => match c.subscribe(&[&sub.topic]) {
                Ok(()) => break Arc::new(c),
                Err(e) => {
                    tracing::error!(topic = %sub.topic, error = %e, "cannot subscribe; retrying")
                }
            },
            Err(e) => {
                tracing::error!(topic = %sub.topic, error = %e, "cannot create a Kafka consumer; retrying")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = stop.wait_for(|s| *s) => return false,
        }
    };
    let committer = tokio::spawn(commit_stored(
        consumer.clone(),
        sub.topic.clone(),
        Duration::from_millis(k.commit_interval_ms.max(1)),
        stop.clone(),
    ));
    let permits = Arc::new(Semaphore::new(k.max_in_flight.max(1)));
    let mut lanes: HashMap<i32, mpsc::UnboundedSender<Queued>> = HashMap::new();
    let mut lane_tasks = Vec::new();
    let mut last_error: Option<Instant> = None;
    let mut restart = false;
    loop {
        let permit = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let received = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            m = consumer.recv() => m,
        };
        let message = match received {
            Ok(m) => m.detach(),
            Err(e) => {
                // Broker down, rebalancing...: librdkafka reconnects by itself.
                if last_error.is_none_or(|t| t.elapsed() > Duration::from_secs(30)) {
                    tracing::warn!(topic = %sub.topic, error = %e, "Kafka consumer error");
                    last_error = Some(Instant::now());
                }
                continue;
            }
        };
        let partition = message.partition();
        let epoch = partitions.epoch(partition);
        let lane = lanes.entry(partition).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            lane_tasks.push(tokio::spawn(lane(
                app.clone(),
                sub.clone(),
                consumer.clone(),
                rx,
                stop.clone(),
                partitions.clone(),
            )));
            tx
        });
        // The permit travels with the message: the semaphore bounds the lanes.
        if lane.send((message, epoch, permit)).is_err() && !*stop.borrow() {
            // A lane ends only when the consumer stops; one gone otherwise is
            // a bug. Its partition's later messages must not run past the
            // lost one: stop here, commit what finished, start over from the
            // committed offsets.
            tracing::error!(topic = %sub.topic, partition, "a partition lane ended unexpectedly; restarting the consumer");
            restart = true;
            break;
        }
    }
    drop(lanes);
    futures_util::future::join_all(lane_tasks).await;
    committer.abort();
    // Commit exactly what finished (never the fetch position).
    let done = std::mem::take(&mut lock(&partitions.state).finished);
    if !done.is_empty() {
        let mut tpl = TopicPartitionList::new();
        for (partition, next) in &done {
            let _ = tpl.add_partition_offset(&sub.topic, *partition, Offset::Offset(*next));
        }
        if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
            tracing::warn!(topic = %sub.topic, error = %e, "final offset commit failed; finished messages may be redelivered");
        }
    }
    tracing::info!(channel = %sub.channel, topic = %sub.topic, "Kafka consumer stopped");
    restart
}

/// Commits the offsets the lanes stored, every `interval`, until the consumer
/// stops (its final commit is `consume`'s). librdkafka commits only for the
/// partitions this member owns, so a revoked partition is never committed
/// here behind its new owner's back.
async fn commit_stored(
    consumer: Arc<Kafka>,
    topic: String,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match consumer.commit_consumer_state(CommitMode::Async) {
            Ok(()) => {}
            // Nothing finished since the last commit.
            Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::NoOffset) => {}
            Err(e) => {
                tracing::warn!(topic = %topic, error = %e, "offset commit failed; retried at the next interval")
            }
        }
    }
}

/// Sleeps `delay` (doubling it up to 10 s for the next time) unless the
/// consumer stops first; `false` when it does.
async fn backoff(stop: &watch::Receiver<bool>, delay: &mut Duration) -> bool {
    let mut stop = stop.clone();
    let wait = *delay;
    *delay = (*delay * 2).min(Duration::from_secs(10));
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        _ = stop.wait_for(|s| *s) => return false,
    }
    !*stop.borrow()
}

/// Runs one partition's messages in order.
async fn lane(
    app: Arc<App>,
    sub: Subscription,
    consumer: Arc<Kafka>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    stop: watch::Receiver<bool>,
    partitions: Arc<Partitions>,
) {
    while let Some((message, epoch, _permit)) = rx.recv().await {
        if *stop.borrow() {
            // Not started: left uncommitted, redelivered to the next consumer.
            break;
        }
        let partition = message.partition();
        {
            let mut st = lock(&partitions.state);
            if st.epoch.get(&partition).copied().unwrap_or(0) != epoch {
                // Fetched before the partition was revoked: its new owner
                // reads it from the committed offset.
                continue;
            }
            st.busy.insert(partition);
        }
        let done = handle(&app, &sub, &message, &stop).await;
        let keep = done && lock(&partitions.state).owns(partition, epoch);
        if keep {
            // Fails only when the partition is gone meanwhile: the new owner
            // redelivers from the last commit (at least once).
            if let Err(e) = consumer.store_offset(&sub.topic, partition, message.offset()) {
                tracing::debug!(topic = %sub.topic, partition, error = %e, "offset not stored");
            }
        }
        {
            let mut st = lock(&partitions.state);
            st.busy.remove(&partition);
            if keep && st.owns(partition, epoch) {
                st.finished.insert(partition, message.offset() + 1);
            }
        }
        partitions.idle.notify_all();
        if !done {
            // Only a stopping consumer leaves a message unfinished.
            break;
        }
    }
}

/// Runs and records one message; `false` only when the consumer stopped
/// before the message's dead letter or trace could be stored (it must not be
/// committed then: it is redelivered).
async fn handle(
    app: &App,
    sub: &Subscription,
    message: &OwnedMessage,
    stop: &watch::Receiver<bool>,
) -> bool {
    let started = Instant::now();
    let started_at = now_micros();
    let trace_id = uuid::Uuid::new_v4().to_string();
    let key = message
        .key()
        .map(|k| String::from_utf8_lossy(k).into_owned());
    // As an HTTP request's headers: names lowercased, a repeated name's
    // values joined with ", " in order, a value that is not UTF-8 left out
    // (a header without a value reads as "").
    let mut headers = Map::new();
    if let Some(h) = message.headers() {
        for header in h.iter() {
            let value = match header.value.map(std::str::from_utf8) {
                None => "",
                Some(Ok(v)) => v,
                Some(Err(_)) => continue,
            };
            match headers.entry(header.key.to_ascii_lowercase()) {
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(Json::String(value.to_owned()));
                }
                serde_json::map::Entry::Occupied(mut slot) => {
                    if let Json::String(joined) = slot.get_mut() {
                        joined.push_str(", ");
                        joined.push_str(value);
                    }
                }
            }
        }
    }
    let mut metadata = json!({
        "headers": headers,
        "request_id": trace_id,
        "topic": sub.topic,
        "partition": message.partition().to_string(),
        "offset": message.offset().to_string(),
    });
    if let Some(k) = &key {
        metadata["key"] = Json::String(k.clone());
    }
    // The rollout bucket, as an HTTP request's: header `x-rollout-key`,
    // then `authorization`, then the message key; a message with none of
    // them is placed by where it sits in the log, so keyless traffic still
    // splits by the versions' shares (and a redelivery goes the same way).
    let bucket = {
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .filter_map(|(k, v)| v.as_str().map(|v| (k.as_str(), v)))
            .collect();
        let place = format!("{}/{}/{}", sub.topic, message.partition(), message.offset());
        sluice_runtime::rollout::bucket_for(&pairs, key.as_deref(), Some(&place))
    };
    // Header values that look secret never reach storage, nor the run
    // (as an async HTTP request's: its workflow sees them masked, on its
    // first run and on a retry alike).
    let mut stored_meta = metadata.clone();
    let mut masked_headers = json!({"headers": stored_meta["headers"].take()});
    sluice_compiler::validate::mask_secrets(&mut masked_headers);
    stored_meta["headers"] = masked_headers["headers"].take();

    let raw = message.payload().unwrap_or_default();
    // As deep as an HTTP body may nest (serde_json alone stops at 128).
    let parsed = sluice_runtime::json::to_serde(raw, sluice_runtime::json::MAX_BODY_NESTING);
    let mut outcome = Outcome {
        trace_id: trace_id.clone(),
        attempt: 1,
        workflow_id: None,
        workflow_version: None,
        data: None,
        errors: Json::Array(Vec::new()),
        duration_ms: 0.0,
    };
    let snapshot = app.engine.load_full();
    // A message that cannot run at all (not JSON, or a payload the trace
    // store cannot keep) is dead-lettered, never retried: its trace keeps
    // the value as text.
    let refuse = |outcome: &mut Outcome, message: String, text: String| {
        outcome.errors = json!([{"code": "BAD_REQUEST", "task_id": "", "message": message}]);
        (
            false,
            Json::String(text.clone()),
            Json::String(text).to_string(),
            true,
        )
    };
    let (ok, payload_json, payload_text, malformed) = match parsed {
        Err(e) => refuse(
            &mut outcome,
            format!("the message value is not JSON: {e}"),
            String::from_utf8_lossy(raw).into_owned(),
        ),
        Ok(value) => {
            let payload = match value {
                Json::Object(mut m) if m.contains_key("data") => {
                    m.remove("data").unwrap_or_default()
                }
                other => other,
            };
            let text = payload.to_string();
            if let Some(limit) = app.store.json_depth()
                && !sluice_runtime::json::nests_within(text.as_bytes(), limit)
            {
                let message = format!(
                    "the payload nests deeper than the {limit} levels the trace store keeps"
                );
                // The dead letter carries the payload as it came.
                let (ok, _, stored, malformed) = refuse(&mut outcome, message, text);
                (ok, payload, stored, malformed)
            } else if let Some(refusal) = snapshot.channels.get(&sub.channel).and_then(|channel| {
                crate::governance::validate_message(channel, &payload, &headers)
            }) {
                // Refused as an HTTP request would be: not run, not retried.
                outcome.errors =
                    json!([{"code": "BAD_REQUEST", "task_id": "", "message": refusal}]);
                (false, payload, text, true)
            } else {
                let ok = match snapshot.channels.get(&sub.channel) {
                    None => {
                        outcome.errors = json!([{"code": "NOT_FOUND", "task_id": "",
                        "message": format!("Channel '{}' not found", sub.channel)}]);
                        false
                    }
                    Some(channel) => {
                        let claimed = crate::storage::Claimed {
                            trace_id: trace_id.clone(),
                            channel: channel.name.clone(),
                            attempt: 1,
                            bucket,
                            payload: text.clone(),
                            metadata: stored_meta.to_string(),
                        };
                        // A panicking run is a failed run, never a lost lane.
                        let ok =
                            crate::queue::execute_guarded(app, channel, &claimed, &mut outcome)
                                .await;
                        crate::queue::count_run(channel, &outcome, ok, started);
                        if !ok {
                            crate::queue::log_failure(&outcome, &claimed);
                        }
                        ok
                    }
                };
                (ok, payload, text, false)
            }
        }
    };
    // A message refused before it ran (not JSON, too deep) counts too, as
    // a refused request does: `rejected`, and `errors_total{BAD_REQUEST}`.
    if malformed && let Some(channel) = snapshot.channels.get(&sub.channel) {
        crate::queue::count_run(channel, &outcome, false, started);
    }
    crate::queue::drop_unstorable_result(app, &mut outcome);
    outcome.duration_ms = sluice_runtime::exec::millis(started.elapsed());
    let dlq_enabled = app.config.kafka.dlq.enabled;
    if !ok && dlq_enabled {
        let first = outcome
            .errors
            .as_array()
            .and_then(|a| a.first())
            .cloned()
            .unwrap_or_else(
                || json!({"code": "INTERNAL_ERROR", "task_id": "", "message": "failed"}),
            );
        let letter = json!({
            "trace_id": trace_id,
            "channel": sub.channel,
            "source_topic": sub.topic,
            "partition": message.partition(),
            "offset": message.offset(),
            "key": key,
            "error": {"code": first["code"], "task_id": first["task_id"], "message": first["message"]},
            "payload": payload_json,
            "failed_at": crate::storage::rfc3339(now_micros()),
        });
        if !publish_dead_letter(app, &letter, key.as_deref(), message.headers(), stop).await {
            return false;
        }
    }
    let trace = NewTrace {
        trace_id,
        channel: sub.channel.clone(),
        mode: "kafka".into(),
        bucket,
        payload: payload_text,
        metadata: stored_meta.to_string(),
        created_at: started_at,
    };
    // Without a DLQ topic, storage keeps the dead letter (retried like an
    // async trace); a message refused before it ran cannot be rerun.
    let dead_letter = (!dlq_enabled && !malformed)
        .then(|| crate::queue::Queue::retry_policy(&app.config.queue))
        .filter(|_| app.config.queue.dlq_retry_enabled);
    // The offset is stored only once the trace is: a message's trace is
    // never lost. Retried until the database takes it (a retry finds a row
    // whose commit was acknowledged too late already there) or the consumer
    // stops; a redelivered message runs, and is dead-lettered, again.
    let mut delay = Duration::from_millis(200);
    loop {
        let e = match app
            .store
            .insert_finished_trace(&trace, &outcome, ok, started_at, dead_letter)
            .await
        {
            Ok(()) => return true,
            Err(e) => e,
        };
        if app.store.get_trace(&trace.trace_id).await.is_ok() {
            return true;
        }
        tracing::error!(trace_id = %trace.trace_id, error = %e, "could not record a Kafka trace; retrying (its offset waits)");
        if !backoff(stop, &mut delay).await {
            return false;
        }
    }
}

/// Publishes a dead letter, retrying (with backoff) until it is stored or the
/// consumer stops.
async fn publish_dead_letter(
    app: &App,
    letter: &Json,
    key: Option<&str>,
    headers: Option<&rdkafka::message::OwnedHeaders>,
    stop: &watch::Receiver<bool>,
) -> bool {
    let k = &app.config.kafka;
    let timeout = Duration::from_secs(app.config.engine.global_http_timeout_secs.max(1));
    let mut delay = Duration::from_millis(200);
    let producer = loop {
        match app
            .kafka
            .dlq
            .get_or_try_init(|| async {
                crate::connectors::kafka::producer_config(
                    &k.brokers,
                    Some("sluice-dlq"),
                    None,
                    timeout,
                )
                .create::<FutureProducer>()
            })
            .await
        {
            Ok(p) => break p,
            Err(e) => {
                tracing::error!(error = %e, "cannot create the dead-letter producer; retrying")
            }
        }
        if !backoff(stop, &mut delay).await {
            return false;
        }
    };
    let body = letter.to_string();
    let mut delay = Duration::from_millis(200);
    loop {
        let mut record = FutureRecord::to(&k.dlq.topic).payload(&body);
        if let Some(key) = key {
            record = record.key(key);
        }
        // The message's own headers go along (`traceparent` among them), so
        // a dead letter stays in its trace and keeps what its producer sent.
        if let Some(headers) = headers {
            record = record.headers(headers.clone());
        }
        match producer.send(record, Timeout::After(timeout)).await {
            Ok(_) => return true,
            Err((e, _)) => {
                tracing::warn!(topic = %k.dlq.topic, error = %e, "dead letter not published; retrying");
            }
        }
        if !backoff(stop, &mut delay).await {
            return false;
        }
    }
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
