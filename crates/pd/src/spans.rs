//! A node's spans of each request (issue 19, observability): the node loop
//! shows it every message in and out and every compute it starts; it keeps
//! each traced request's current phase and when it began, and hands a
//! finished phase to [`telemetry::Telemetry::record`] (logged, exported
//! with `--otlp-endpoint`).
//!
//! * prefill node: `queue` (the `Prefill` message in → compute starts: the
//!   wait for pages and a batch slot), `prefill` (compute → `Done` out: the
//!   prompt's KV computed and every page sent);
//! * decode node: `queue` (`Reserve` in → `Reserved` out: the wait for
//!   pages), `transfer` (→ prefill's `Done` in: the KV arriving), `decode`
//!   (→ `Finished` out).
//!
//! A request that ends early (refused, cancelled, aborted, lost) ends its
//! current phase with the reason. Only requests that carry a trace context
//! are tracked, at most [`TRACKED_MAX`] at once (the oldest are dropped).

use std::collections::{HashMap, VecDeque};
use std::time::SystemTime;

use request::trace::TraceContext;
use request::RequestId;
use telemetry::{Span, Telemetry};
use transfer::wire::Message;

/// Requests tracked at once.
pub const TRACKED_MAX: usize = 4096;

struct Open {
    parent: TraceContext,
    phase: &'static str,
    since: SystemTime,
}

pub(crate) struct NodeSpans {
    telemetry: Telemetry,
    open: HashMap<RequestId, Open>,
    order: VecDeque<RequestId>,
}

impl NodeSpans {
    pub(crate) fn new(telemetry: Telemetry) -> NodeSpans {
        NodeSpans {
            telemetry,
            open: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn begin(&mut self, req: RequestId, parent: TraceContext, phase: &'static str) {
        if self.open.contains_key(&req) {
            return;
        }
        while self.open.len() >= TRACKED_MAX {
            match self.order.pop_front() {
                Some(old) => {
                    self.open.remove(&old);
                }
                None => break,
            }
        }
        self.order.push_back(req);
        self.open.insert(
            req,
            Open {
                parent,
                phase,
                since: SystemTime::now(),
            },
        );
        debug_assert!(self.open.len() <= TRACKED_MAX);
    }

    /// Ends the current phase of `req` if it is `phase` (any phase when
    /// `None`); then `next` begins, or the request is forgotten.
    fn end(
        &mut self,
        req: RequestId,
        phase: Option<&'static str>,
        next: Option<&'static str>,
        error: Option<String>,
        attrs: Vec<(&'static str, i64)>,
    ) {
        let Some(o) = self.open.get_mut(&req) else {
            return;
        };
        if phase.is_some_and(|p| p != o.phase) {
            return;
        }
        let now = SystemTime::now();
        let mut span = Span::new(o.phase, o.parent, o.since, now, req);
        span.error = error;
        span.attrs = attrs;
        match next {
            Some(n) => {
                o.phase = n;
                o.since = now;
            }
            None => {
                self.open.remove(&req);
                self.order.retain(|&r| r != req);
            }
        }
        self.telemetry.record(&span);
    }

    /// A message that arrived.
    pub(crate) fn inbound(&mut self, msg: &Message) {
        match msg {
            Message::Prefill { req, gen, .. } | Message::Reserve { req, gen, .. } => {
                if let Some(t) = gen.trace.as_deref() {
                    self.begin(*req, *t, "queue");
                }
            }
            // Decode: prefill's last page and verdict material.
            Message::Done {
                req,
                page_count,
                cached_tokens,
                ..
            } => self.end(
                *req,
                Some("transfer"),
                Some("decode"),
                None,
                vec![
                    ("isoserve.pages", i64::from(*page_count)),
                    ("isoserve.cached_tokens", i64::from(*cached_tokens)),
                ],
            ),
            Message::Abort { req, error } => {
                self.end(*req, None, None, Some(error.code.clone()), vec![])
            }
            Message::Cancel { req } => self.end(*req, None, None, Some("cancelled".into()), vec![]),
            _ => {}
        }
    }

    /// A message this node sent.
    pub(crate) fn outbound(&mut self, msg: &Message) {
        match msg {
            Message::Reserved { req, pages } => self.end(
                *req,
                Some("queue"),
                Some("transfer"),
                None,
                vec![("isoserve.pages", pages.len() as i64)],
            ),
            Message::Done {
                req,
                page_count,
                token_count,
                cached_tokens,
                ..
            } => self.end(
                *req,
                Some("prefill"),
                None,
                None,
                vec![
                    ("isoserve.pages", i64::from(*page_count)),
                    ("isoserve.prompt_tokens", i64::from(*token_count)),
                    ("isoserve.cached_tokens", i64::from(*cached_tokens)),
                ],
            ),
            Message::Finished {
                req,
                completion_tokens,
                ..
            } => self.end(
                *req,
                Some("decode"),
                None,
                None,
                vec![("isoserve.completion_tokens", i64::from(*completion_tokens))],
            ),
            Message::Rejected { req, error } | Message::Abort { req, error } => {
                self.end(*req, None, None, Some(error.code.clone()), vec![])
            }
            _ => {}
        }
    }

    /// Prefill: the engine started computing `req` (its pages allocated).
    pub(crate) fn computing(&mut self, req: RequestId) {
        self.end(req, Some("queue"), Some("prefill"), None, vec![]);
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use request::TenantId;
    use transfer::wire::{GenSpec, Refusal, WirePage};

    fn traced() -> GenSpec {
        GenSpec {
            trace: Some(Box::new(telemetry::new_trace())),
            ..GenSpec::greedy()
        }
    }

    fn names(kept: &std::sync::Mutex<Vec<Span>>) -> Vec<(&'static str, Option<String>)> {
        kept.lock()
            .unwrap()
            .iter()
            .map(|s| (s.name, s.error.clone()))
            .collect()
    }

    #[test]
    fn a_decode_node_records_queue_transfer_and_decode_under_the_gateways_span() {
        let (t, kept) = Telemetry::keeping("isoserve-decode");
        let mut s = NodeSpans::new(t);
        let gen = traced();
        let parent = *gen.trace.clone().unwrap();
        s.inbound(&Message::Reserve {
            req: RequestId(7),
            tenant: TenantId(1),
            prefill: "p".into(),
            tokens: vec![1, 2],
            max_tokens: 3,
            gen,
        });
        s.outbound(&Message::Reserved {
            req: RequestId(7),
            pages: vec![WirePage { index: 1, epoch: 1 }],
        });
        s.inbound(&Message::Done {
            req: RequestId(7),
            first_token: 5,
            first_logprobs: None,
            sampler_state: 0,
            page_count: 1,
            token_count: 2,
            cached_tokens: 0,
            digest: 0,
        });
        s.outbound(&Message::Finished {
            req: RequestId(7),
            finish: 1,
            prompt_tokens: 2,
            cached_tokens: 0,
            completion_tokens: 3,
            streamed: 3,
            prediction: Default::default(),
            tail_text: String::new(),
        });
        assert_eq!(
            names(&kept),
            vec![("queue", None), ("transfer", None), ("decode", None)]
        );
        let k = kept.lock().unwrap();
        assert!(k
            .iter()
            .all(|sp| sp.parent == parent && sp.req == RequestId(7)));
        // Phases follow each other: each starts where the previous ended.
        assert!(k.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(k[2].attrs, vec![("isoserve.completion_tokens", 3)]);
        drop(k);
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn a_prefill_node_records_queue_then_prefill_and_early_ends_carry_the_reason() {
        let (t, kept) = Telemetry::keeping("isoserve-prefill");
        let mut s = NodeSpans::new(t);
        let prefill = |req| Message::Prefill {
            req: RequestId(req),
            tenant: TenantId(1),
            decode: "d:1".into(),
            tokens: vec![1],
            max_tokens: 1,
            gen: traced(),
            pages: vec![],
        };
        s.inbound(&prefill(1));
        // Done before compute started is not the prefill phase's end.
        s.computing(RequestId(1));
        s.outbound(&Message::Done {
            req: RequestId(1),
            first_token: 5,
            first_logprobs: None,
            sampler_state: 0,
            page_count: 1,
            token_count: 1,
            cached_tokens: 0,
            digest: 0,
        });
        s.inbound(&prefill(2));
        s.outbound(&Message::Rejected {
            req: RequestId(2),
            error: Refusal {
                status: 503,
                code: "draining".into(),
                message: "m".into(),
            },
        });
        s.inbound(&prefill(3));
        s.inbound(&Message::Cancel { req: RequestId(3) });
        assert_eq!(
            names(&kept),
            vec![
                ("queue", None),
                ("prefill", None),
                ("queue", Some("draining".into())),
                ("queue", Some("cancelled".into())),
            ]
        );
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn untraced_requests_are_not_tracked_and_tracking_is_bounded() {
        let (t, kept) = Telemetry::keeping("isoserve-decode");
        let mut s = NodeSpans::new(t);
        let reserve = |req, gen| Message::Reserve {
            req: RequestId(req),
            tenant: TenantId(1),
            prefill: "p".into(),
            tokens: vec![1],
            max_tokens: 1,
            gen,
        };
        s.inbound(&reserve(1, GenSpec::greedy()));
        s.outbound(&Message::Reserved {
            req: RequestId(1),
            pages: vec![],
        });
        assert_eq!((s.tracked(), kept.lock().unwrap().len()), (0, 0));
        for req in 0..(TRACKED_MAX as u64 + 10) {
            s.inbound(&reserve(req, traced()));
        }
        assert_eq!(s.tracked(), TRACKED_MAX);
        // The oldest were dropped: their ends record nothing.
        s.outbound(&Message::Reserved {
            req: RequestId(0),
            pages: vec![],
        });
        assert_eq!(kept.lock().unwrap().len(), 0);
        s.outbound(&Message::Reserved {
            req: RequestId(TRACKED_MAX as u64 + 9),
            pages: vec![],
        });
        assert_eq!(kept.lock().unwrap().len(), 1);
    }
}
