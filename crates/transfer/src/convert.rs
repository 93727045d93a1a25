//! Between the request vocabulary (`request`) and the wire: sampling
//! parameters, requests, errors (as the original error a node sends, K9)
//! and log-probabilities, both ways. Pure functions, no state.

use request::{GenRequest, RequestError, SamplingParams, TenantId};

use crate::wire::{GenSpec, Refusal, WireLogprobs};

/// A request's sampling on the wire → the engine's parameters.
pub fn params_of(g: &GenSpec) -> SamplingParams {
    SamplingParams {
        temperature: g.temperature(),
        top_k: g.top_k as usize,
        top_p: g.top_p(),
        min_p: g.min_p(),
        repetition_penalty: g.repetition_penalty(),
        presence_penalty: g.presence_penalty(),
        frequency_penalty: g.frequency_penalty(),
        seed: g.seed,
        logit_bias: g
            .logit_bias
            .iter()
            .map(|&(t, b)| (t, f32::from_bits(b)))
            .collect(),
    }
}

/// The engine's request → its sampling on the wire.
pub fn gen_spec(req: &GenRequest) -> GenSpec {
    let p = &req.params;
    GenSpec {
        temperature_bits: p.temperature.to_bits(),
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        top_p_bits: p.top_p.to_bits(),
        min_p_bits: p.min_p.to_bits(),
        repetition_penalty_bits: p.repetition_penalty.to_bits(),
        presence_penalty_bits: p.presence_penalty.to_bits(),
        frequency_penalty_bits: p.frequency_penalty.to_bits(),
        seed: p.seed,
        ignore_eos: req.ignore_eos,
        logprobs: req.logprobs.map(|n| n.min(u8::MAX as usize) as u8),
        stop: req.stop.clone(),
        logit_bias: p
            .logit_bias
            .iter()
            .map(|&(t, b)| (t, b.to_bits()))
            .collect(),
        cache_scope: req.cache_scope,
        priority: req.priority,
        weight: req.weight.clamp(1, request::WEIGHT_MAX),
        trace: req.trace.map(Box::new),
        grammar: req.grammar.as_ref().map(|c| Box::new((*c.spec).clone())),
        prediction: (!req.prediction.is_empty()).then(|| req.prediction.clone().into_boxed_slice()),
    }
}

/// A request as a node receives it → the engine's request (to validate it
/// with the same rules as the unified engine).
pub fn gen_request(tenant: TenantId, tokens: &[u32], max_tokens: u32, g: &GenSpec) -> GenRequest {
    GenRequest {
        tenant,
        prompt: tokens.to_vec(),
        max_tokens: max_tokens as usize,
        params: params_of(g),
        stop: g.stop.clone(),
        ignore_eos: g.ignore_eos,
        logprobs: g.logprobs.map(usize::from),
        cache_scope: g.cache_scope,
        priority: g.priority,
        weight: g.weight,
        trace: g.trace.as_deref().copied(),
        grammar: g
            .grammar
            .as_deref()
            .map(|s| request::Constraint::new(s.clone())),
        prediction: g.prediction.as_deref().unwrap_or_default().to_vec(),
    }
}

/// An engine error as the original error on the wire (K9).
pub fn refusal_of(e: &RequestError) -> Refusal {
    let status = match e {
        RequestError::ContextLengthExceeded { .. }
        | RequestError::EmptyPrompt
        | RequestError::InvalidParam { .. }
        | RequestError::Grammar(_) => 400,
        RequestError::QueueFull { .. } => 429,
        RequestError::ShuttingDown => 503,
        RequestError::ClientTooSlow { .. } => 408,
        RequestError::Internal(_) => 500,
        RequestError::Remote { status, .. } => *status,
    };
    let code = match e {
        RequestError::Remote { code, .. } => code.clone(),
        e => e.kind().to_string(),
    };
    let message = match e {
        RequestError::Remote { message, .. } => message.clone(),
        e => e.to_string(),
    };
    Refusal {
        status,
        code,
        message,
    }
}

pub fn wire_logprobs(l: Option<(f32, Vec<(u32, f32)>)>) -> Option<WireLogprobs> {
    l.map(|(lp, top)| WireLogprobs {
        logprob_bits: lp.to_bits(),
        top: top.into_iter().map(|(id, v)| (id, v.to_bits())).collect(),
    })
}

pub fn engine_logprobs(l: Option<WireLogprobs>) -> Option<(f32, Vec<(u32, f32)>)> {
    l.map(|w| {
        (
            f32::from_bits(w.logprob_bits),
            w.top
                .into_iter()
                .map(|(id, b)| (id, f32::from_bits(b)))
                .collect(),
        )
    })
}
