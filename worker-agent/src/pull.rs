//! Pull requests on the agent's WORK consumer, all answered on one long-lived inbox.
//!
//! Why not the client's one-shot batches: a batch listens on an inbox of its own and ends
//! when the server answers its expiry (408). nats-server can remove an expired pull request
//! without that answer when the timing is tight (nats-io/nats-server#3942, merged March
//! 2023; Debian bookworm ships 2.9.10, of December 2022), and the client then waits for its
//! own fallback, the expiry plus 5 s. While it waits nothing is pulled: the GPU starts no new job for about 5.5 s
//! while the dispatcher keeps placing work there (seen in the fairness drill: one GPU's
//! running jobs fell from 18 to 3, nothing waiting, until 20 assignments arrived at once).
//! Giving up on a batch sooner is not safe, since a server that still holds the request
//! would deliver to an inbox nobody reads, and those assignments would wait for the ack
//! timeout. Here every request names the same inbox, which stays subscribed: a request
//! whose answer does not come by its expiry plus [`ANSWER_GRACE`] is followed by the next
//! one, and whatever any of them delivers is still read.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::StatusCode;
use futures::StreamExt;
use metronome_protocol::names::{work_consumer, STREAM_WORK};
use serde::Serialize;

/// How long a pull request waits on the server for work.
pub const PULL_EXPIRES: Duration = Duration::from_millis(500);

/// How long past its expiry a request's end is waited for before the next is sent.
pub const ANSWER_GRACE: Duration = Duration::from_millis(250);

/// What one read from the inbox gave.
pub enum Pulled {
    /// A delivered message (an assignment, or something that claims to be one).
    Message(Box<jetstream::Message>),
    /// The server ended a request (expired, or stopped for another reason): pull again.
    Ended,
    /// A request the server refused or ended with an error status (e.g. a consumer limit);
    /// its description.
    Refused(String),
    /// No answer within the request's expiry and the grace: pull again.
    Unanswered,
    /// The inbox subscription ended (the connection is closing).
    Closed,
}

/// The body of `$JS.API.CONSUMER.MSG.NEXT`.
#[derive(Serialize)]
struct PullRequest {
    batch: usize,
    /// Nanoseconds.
    expires: u64,
}

/// Pull requests for one consumer, answered on one inbox.
pub struct Puller {
    context: jetstream::Context,
    subject: String,
    inbox: String,
    subscriber: async_nats::Subscriber,
}

impl Puller {
    /// Subscribe the inbox that every request of `worker_id`'s consumer is answered on.
    pub async fn new(
        context: jetstream::Context,
        worker_id: &str,
    ) -> Result<Puller, async_nats::SubscribeError> {
        let client = context.client();
        let inbox = client.new_inbox();
        let subscriber = client.subscribe(inbox.clone()).await?;
        Ok(Puller {
            subject: format!(
                "$JS.API.CONSUMER.MSG.NEXT.{STREAM_WORK}.{}",
                work_consumer(worker_id)
            ),
            context,
            inbox,
            subscriber,
        })
    }

    /// Ask for up to `batch` messages, delivered within `expires` (the agent uses
    /// [`PULL_EXPIRES`]).
    pub async fn request(
        &self,
        batch: usize,
        expires: Duration,
    ) -> Result<(), async_nats::PublishError> {
        let body = serde_json::to_vec(&PullRequest {
            batch,
            expires: expires.as_nanos() as u64,
        })
        .expect("a pull request encodes");
        self.context
            .client()
            .publish_with_reply(self.subject.clone(), self.inbox.clone(), body.into())
            .await
    }

    /// The next answer to the requests sent, waiting at most until `deadline` (the last
    /// request's expiry plus [`ANSWER_GRACE`]).
    pub async fn next(&mut self, deadline: tokio::time::Instant) -> Pulled {
        loop {
            let message = tokio::select! {
                m = self.subscriber.next() => m,
                _ = tokio::time::sleep_until(deadline) => return Pulled::Unanswered,
            };
            let Some(message) = message else {
                return Pulled::Closed;
            };
            match message.status {
                None | Some(StatusCode::OK) => {
                    return Pulled::Message(Box::new(jetstream::Message {
                        message,
                        context: self.context.clone(),
                    }))
                }
                Some(StatusCode::IDLE_HEARTBEAT) => continue,
                Some(StatusCode::TIMEOUT) | Some(StatusCode::NOT_FOUND) => return Pulled::Ended,
                Some(status) => {
                    let why = message.description.clone().unwrap_or_default();
                    return Pulled::Refused(format!("{status} {why}"));
                }
            }
        }
    }
}
