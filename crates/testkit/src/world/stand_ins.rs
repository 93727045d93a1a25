//! The stand-ins: a model whose next token hashes every KV row the
//! sequence reads through the pool (so a wrong page changes the tokens),
//! its reference computed from the tokens alone, and the prefill and
//! decode engines the node glue drives in place of the batch core.

use super::*;

// ------------------------------------------------------------- the model

/// Shape of the stand-in model's KV: layers × (1 head of `WIDTH`).
pub const LAYERS: usize = 2;
pub const WIDTH: usize = 4;
pub const VOCAB: u32 = 1000;

/// K row of (token, position, layer); V is K + 0.5.
pub(super) fn kv_row(token: u32, pos: usize, layer: usize) -> [f32; WIDTH] {
    [
        token as f32,
        pos as f32,
        layer as f32,
        ((token as usize * 31 + pos * 7 + layer) % 97) as f32,
    ]
}

pub(super) fn mix(acc: u64, v: u64) -> u64 {
    let mut z = acc ^ v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 32)
}

/// Hash of the rows of one (position, layer).
pub(super) fn row_hash(pos: usize, layer: usize, k: &[f32], v: &[f32]) -> u64 {
    let mut h = mix(pos as u64, layer as u64);
    for x in k.iter().chain(v) {
        h = mix(h, x.to_bits() as u64);
    }
    h
}

pub(super) fn token_of(sum: u64) -> u32 {
    (mix(sum, 0x70c3) % VOCAB as u64) as u32
}

/// The reference: the next token after `seq`, from the tokens alone.
pub fn reference_next(seq: &[u32]) -> u32 {
    let mut sum = 0u64;
    for (pos, &t) in seq.iter().enumerate() {
        for layer in 0..LAYERS {
            let k = kv_row(t, pos, layer);
            let v = k.map(|x| x + 0.5);
            sum = sum.wrapping_add(row_hash(pos, layer, &k, &v));
        }
    }
    token_of(sum)
}

/// The reference generation of `max_tokens` tokens.
pub fn reference_tokens(prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let t = reference_next(&seq);
        out.push(t);
        seq.push(t);
    }
    out
}

/// Prefill (or a decode step) of the stand-in: writes the rows of `token`
/// at `pos` through the pool.
pub fn write_kv(
    pool: &mut Pool,
    pages: &[PageRef],
    owner: Owner,
    ps: usize,
    pos: usize,
    token: u32,
) -> Result<(), kv::KvError> {
    for layer in 0..LAYERS {
        let k = kv_row(token, pos, layer);
        let v = k.map(|x| x + 0.5);
        pool.write_token(pages[pos / ps], owner, layer, pos % ps, &k, &v)?;
    }
    Ok(())
}

/// The next token after positions `0..n`, reading every row through the
/// pool (K1–K3 checked on every read).
pub fn next_from_pool(
    pool: &Pool,
    pages: &[PageRef],
    owner: Owner,
    ps: usize,
    n: usize,
) -> Result<u32, kv::KvError> {
    let mut sum = 0u64;
    for (pi, &h) in pages.iter().enumerate().take(n.div_ceil(ps)) {
        let slots = (n - pi * ps).min(ps);
        for layer in 0..LAYERS {
            match pool.read_layer(h, owner, layer, slots)? {
                LayerView::F32 { k, v } => {
                    for s in 0..slots {
                        let pos = pi * ps + s;
                        sum = sum.wrapping_add(row_hash(
                            pos,
                            layer,
                            &k[s * WIDTH..(s + 1) * WIDTH],
                            &v[s * WIDTH..(s + 1) * WIDTH],
                        ));
                    }
                }
                LayerView::F16 { .. } | LayerView::Q8_0 { .. } => {
                    unreachable!("the stand-in's pools are f32")
                }
            }
        }
    }
    Ok(token_of(sum))
}

/// The KV shape of the stand-in model with `page_size` slots per page.
pub fn shape(page_size: u32) -> kv::KvShape {
    kv::KvShape::new(LAYERS, 1, WIDTH, page_size as usize, kv::DType::F32)
        .expect("stand-in shape is valid")
}

/// A node identity for the stand-in model (every node shares the model
/// fingerprint and KV layout).
pub fn identity(node: &str, ps: u32, limit: u32) -> transfer::Identity {
    transfer::Identity {
        node: node.into(),
        fingerprint: [7; 32],
        layout: transfer::wire::KvLayout {
            page_size: ps,
            dtype: 0,
            layers: LAYERS as u32,
            kv_heads: 1,
            head_dim: WIDTH as u32,
        },
        max_request_tokens: limit,
    }
}

// ------------------------------------------------- the stand-in engines

/// Prefill's engine over the stand-in model: a job waits until the driver
/// runs it ([`World::compute`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StandInPrefill {
    pub pool: Pool,
    page_size: usize,
    pub jobs: BTreeMap<RequestId, ComputeJob>,
    reports: Vec<PrefillReport>,
}

impl StandInPrefill {
    pub fn new(pool: Pool, page_size: u32) -> StandInPrefill {
        StandInPrefill {
            pool,
            page_size: page_size as usize,
            jobs: BTreeMap::new(),
            reports: Vec::new(),
        }
    }

    /// Runs one job: writes the prompt's KV past its cached prefix, reads
    /// all of it back (cached pages included) for the first token.
    pub fn run(&mut self, req: RequestId) {
        let Some(job) = self.jobs.remove(&req) else {
            return;
        };
        let ps = self.page_size;
        let mut result = Ok(());
        let from = job.cached_tokens as usize;
        for (pos, &t) in job.tokens.iter().enumerate().skip(from) {
            result =
                result.and_then(|()| write_kv(&mut self.pool, &job.pages, job.owner, ps, pos, t));
        }
        let first = result
            .and_then(|()| next_from_pool(&self.pool, &job.pages, job.owner, ps, job.tokens.len()));
        self.reports.push(match first {
            Ok(t) => PrefillReport::Computed {
                req,
                first: t,
                logprobs: None,
                sampler_state: 0,
            },
            Err(e) => PrefillReport::Failed {
                req,
                error: transfer::refusal::internal(e.to_string()),
            },
        });
    }
}

/// The stand-in's parameter checks (the real engine checks far more; a
/// refusal here takes the same path through the glue).
pub(super) fn stand_in_check(tokens: &[u32], max_tokens: u32) -> Result<(), Refusal> {
    if tokens.is_empty() || max_tokens == 0 {
        return Err(transfer::refusal::bad_request(
            "invalid_parameter",
            "the prompt and max_tokens must not be empty",
        ));
    }
    Ok(())
}

impl NodeEngine for StandInPrefill {
    fn pool(&mut self) -> &mut Pool {
        &mut self.pool
    }
    fn check(
        &mut self,
        _: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        _: &GenSpec,
    ) -> Result<(), Refusal> {
        stand_in_check(tokens, max_tokens)
    }
    fn stop(&mut self, req: RequestId) {
        self.jobs.remove(&req);
    }
    fn running(&mut self) -> usize {
        self.jobs.len()
    }
}

impl PrefillEngine for StandInPrefill {
    fn compute(&mut self, job: ComputeJob) {
        self.jobs.insert(job.req, job);
    }
    fn take_reports(&mut self, out: &mut Vec<PrefillReport>) {
        out.append(&mut self.reports);
    }
}

/// What decode's stand-in engine saw when it started a request: the
/// world checks it against the client's prompt (K3/K10) and canaries (K7).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Start {
    pub req: RequestId,
    pub tokens: Vec<u32>,
    /// The next token read from the pages through the pool.
    pub read: Result<u32, String>,
    /// A page whose canary failed, if any.
    pub canary_failed: Option<u32>,
}

/// Decode's engine over the stand-in model: a request decodes one token
/// each time the driver steps it ([`World::decode_step`]) — or, speculating,
/// verifies a one-token draft beside it: right every other step (kept, and
/// the row after it gives a second token), wrong otherwise (its row rolled
/// back with `Pool::rewind`, as the batch core does).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StandInDecode {
    pub pool: Pool,
    page_size: usize,
    /// Verify a draft row each step (issue 37's rewind, in the model).
    pub speculate: bool,
    /// Drafts kept and rolled back so far.
    pub drafts_kept: u32,
    pub drafts_rolled_back: u32,
    /// Test-only: a rejected draft's row stays written (the mutation the
    /// world's K3 check must catch).
    pub skip_rewind: bool,
    pub decoding: BTreeMap<RequestId, Decoding>,
    reports: Vec<DecodeReport>,
    /// Starts since the world last looked.
    pub starts: Vec<Start>,
}

impl StandInDecode {
    pub fn new(pool: Pool, page_size: u32) -> StandInDecode {
        StandInDecode {
            pool,
            page_size: page_size as usize,
            speculate: true,
            drafts_kept: 0,
            drafts_rolled_back: 0,
            skip_rewind: false,
            decoding: BTreeMap::new(),
            reports: Vec::new(),
            starts: Vec::new(),
        }
    }

    /// One decode step of one request.
    pub fn step(&mut self, req: RequestId) {
        let ps = self.page_size;
        let Some(d) = self.decoding.get_mut(&req) else {
            return;
        };
        let n = d.seq.len();
        let last = *d.seq.last().expect("non-empty");
        let mut next = write_kv(&mut self.pool, &d.pages, d.owner, ps, n - 1, last)
            .and_then(|()| next_from_pool(&self.pool, &d.pages, d.owner, ps, n))
            .map(|t| vec![t]);
        // A draft for position n, verified in the same step: right and
        // wrong by turns (a right one's row stays, and gives the token
        // after it; a wrong one's is rolled back: the page's watermark
        // returns to n, so the row reads as unwritten until rewritten).
        let speculate = self.speculate && d.generated + 2 <= d.max_tokens;
        if let (true, Ok(tokens)) = (speculate, next.as_mut()) {
            let t = tokens[0];
            let right = (n / 2).is_multiple_of(2);
            let draft = if right { t } else { t ^ 1 };
            let verified =
                write_kv(&mut self.pool, &d.pages, d.owner, ps, n, draft).and_then(|()| {
                    if draft == t {
                        self.drafts_kept += 1;
                        next_from_pool(&self.pool, &d.pages, d.owner, ps, n + 1).map(Some)
                    } else {
                        self.drafts_rolled_back += 1;
                        if self.skip_rewind {
                            return Ok(None);
                        }
                        self.pool
                            .rewind(d.pages[n / ps], d.owner, n % ps)
                            .map(|()| None)
                    }
                });
            match verified {
                Ok(Some(bonus)) => tokens.push(bonus),
                Ok(None) => {}
                Err(e) => next = Err(e),
            }
        }
        match next {
            Ok(tokens) => {
                let conn = d.conn;
                for &t in &tokens {
                    d.seq.push(t);
                    d.generated += 1;
                    self.reports.push(DecodeReport::Token {
                        req,
                        conn,
                        id: t,
                        text: String::new(),
                        logprobs: None,
                    });
                }
                let done = d.generated >= d.max_tokens;
                let generated = d.generated;
                if done {
                    self.decoding.remove(&req);
                    self.reports.push(DecodeReport::Finished {
                        req,
                        finish: 1,
                        completion_tokens: generated,
                        prediction: Default::default(),
                        tail_text: String::new(),
                    });
                }
            }
            Err(e) => {
                self.decoding.remove(&req);
                self.reports.push(DecodeReport::Failed {
                    req,
                    error: transfer::refusal::internal(e.to_string()),
                });
            }
        }
    }
}

impl NodeEngine for StandInDecode {
    fn pool(&mut self) -> &mut Pool {
        &mut self.pool
    }
    fn check(
        &mut self,
        _: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        _: &GenSpec,
    ) -> Result<(), Refusal> {
        stand_in_check(tokens, max_tokens)
    }
    fn stop(&mut self, req: RequestId) {
        self.decoding.remove(&req);
    }
    fn running(&mut self) -> usize {
        self.decoding.len()
    }
}

impl DecodeEngine for StandInDecode {
    fn start_decode(&mut self, s: DecodeStart) -> Result<(), Refusal> {
        let ps = self.page_size;
        self.starts.push(Start {
            req: s.req,
            tokens: s.tokens.clone(),
            read: next_from_pool(&self.pool, &s.pages, s.owner, ps, s.tokens.len())
                .map_err(|e| e.to_string()),
            canary_failed: s
                .pages
                .iter()
                .find(|&&h| self.pool.check_canary(h, s.owner).is_err())
                .map(|h| h.index),
        });
        let mut seq = s.tokens.clone();
        seq.push(s.first_token);
        self.reports.push(DecodeReport::Token {
            req: s.req,
            conn: s.conn,
            id: s.first_token,
            text: String::new(),
            logprobs: None,
        });
        if s.max_tokens <= 1 {
            self.reports.push(DecodeReport::Finished {
                req: s.req,
                finish: 1,
                completion_tokens: 1,
                prediction: Default::default(),
                tail_text: String::new(),
            });
        } else {
            self.decoding.insert(
                s.req,
                Decoding {
                    owner: s.owner,
                    conn: s.conn,
                    pages: s.pages,
                    seq,
                    generated: 1,
                    max_tokens: s.max_tokens,
                },
            );
        }
        Ok(())
    }
    fn take_reports(&mut self, out: &mut Vec<DecodeReport>) {
        out.append(&mut self.reports);
    }
}
