//! Metrics as data. Every source of metrics (the HTTP layer, the engine's
//! stats, a PD node, the PD gateway) declares its families once, in a
//! table of [`Family`] rows: name, kind, help and label keys. Samples are
//! made from those rows ([`Family::sample`]), so a name or a help text is
//! never written twice; [`check`] says whether samples stay within their
//! tables (each exported name declared, with its kind and label keys, and
//! no name declared twice), which every source's tests run; and
//! [`encode_samples`] writes the Prometheus text through the Prometheus
//! project's client (nobody writes exposition by hand).
//!
//! ```
//! use telemetry::metrics::{check, encode_samples, Family};
//!
//! const REQUESTS: Family = Family::counter("demo_requests_total", "Requests seen");
//! const POOL: Family = Family::gauge("demo_pages", "Pages by state").with_labels(&["state"]);
//! const TABLE: &[Family] = &[REQUESTS, POOL];
//!
//! let samples = vec![REQUESTS.sample(3.0), POOL.sample(7.0).label("state", "free")];
//! check(&[TABLE], &samples).expect("declared");
//! assert!(encode_samples(samples).contains("demo_pages{state=\"free\"} 7"));
//! ```

use std::collections::BTreeSet;
use std::sync::Mutex;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use request::{MetricKind, MetricSample};

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// One metric family as its source declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// The full name; a counter's ends in `_total`.
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
    /// The label keys every sample carries, in order (empty: none).
    pub labels: &'static [&'static str],
}

impl Family {
    pub const fn counter(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Counter,
            help,
            labels: &[],
        }
    }

    pub const fn gauge(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Gauge,
            help,
            labels: &[],
        }
    }

    /// A histogram (its `_bucket`, `_sum` and `_count` series are the
    /// registry's); it has no samples.
    pub const fn histogram(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Histogram,
            help,
            labels: &[],
        }
    }

    /// The name a registry is given: a counter's without `_total` (the
    /// encoder appends it).
    pub fn base(&self) -> &'static str {
        match self.kind {
            MetricKind::Counter => self.name.strip_suffix("_total").unwrap_or(self.name),
            _ => self.name,
        }
    }

    pub const fn with_labels(self, labels: &'static [&'static str]) -> Family {
        Family { labels, ..self }
    }

    /// A sample of this family (add its labels with
    /// [`MetricSample::label`]).
    pub fn sample(&self, value: f64) -> MetricSample {
        let s = match self.kind {
            MetricKind::Counter => MetricSample::counter(self.name, self.help, value),
            MetricKind::Gauge => MetricSample::gauge(self.name, self.help, value),
            MetricKind::Histogram => unreachable!("{}: a histogram has no samples", self.name),
        };
        debug_assert!(self.kind != MetricKind::Counter || self.name.ends_with("_total"));
        s
    }
}

/// Whether `samples` stay within `tables`: every sample's name is
/// declared, with the sample's kind, help and label keys; no name is
/// declared twice across the tables; a counter's name ends in `_total`.
pub fn check(tables: &[&[Family]], samples: &[MetricSample]) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    for f in tables.iter().flat_map(|t| t.iter()) {
        if !seen.insert(f.name) {
            return Err(format!("{} is declared twice", f.name));
        }
        if f.kind == MetricKind::Counter && !f.name.ends_with("_total") {
            return Err(format!("counter {} does not end in _total", f.name));
        }
    }
    for s in samples {
        let Some(f) = tables
            .iter()
            .flat_map(|t| t.iter())
            .find(|f| f.name == s.name)
        else {
            return Err(format!("{} is exported but not declared", s.name));
        };
        if f.kind != s.kind || f.help != s.help {
            return Err(format!("{} is exported unlike its declaration", s.name));
        }
        let keys: Vec<&str> = s.labels.iter().map(|(k, _)| k.as_str()).collect();
        // A gateway adds `node` to its nodes' samples.
        let keys = match keys.last() {
            Some(&"node") if f.labels.last() != Some(&"node") => &keys[..keys.len() - 1],
            _ => &keys[..],
        };
        if keys != f.labels {
            return Err(format!(
                "{} is exported with labels {keys:?}, declared {:?}",
                s.name, f.labels
            ));
        }
    }
    Ok(())
}

/// Samples a backend (or a node) reports, encoded through a registry: one
/// family per name, in order of first appearance; its kind and help are
/// its first sample's.
#[derive(Debug, Default)]
pub struct SamplesCollector {
    pub samples: Mutex<Vec<MetricSample>>,
}

impl Collector for SamplesCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<&str> = Vec::new();
        for s in samples.iter() {
            if !names.contains(&s.name.as_str()) {
                names.push(&s.name);
            }
        }
        for name in names {
            let group: Vec<&MetricSample> = samples.iter().filter(|s| s.name == name).collect();
            let first = group[0];
            let (ty, base) = match first.kind {
                // The encoder appends `_total` to a counter's name.
                MetricKind::Counter => (
                    MetricType::Counter,
                    name.strip_suffix("_total").unwrap_or(name),
                ),
                MetricKind::Gauge | MetricKind::Histogram => (MetricType::Gauge, name),
            };
            let mut m = enc.encode_descriptor(base, &first.help, None, ty)?;
            if group.len() == 1 && first.labels.is_empty() {
                encode_value(first, m)?;
                continue;
            }
            for s in group {
                encode_value(s, m.encode_family(&s.labels)?)?;
            }
        }
        Ok(())
    }
}

/// Encodes one sample's value as its metric kind.
fn encode_value(
    s: &MetricSample,
    m: prometheus_client::encoding::MetricEncoder,
) -> Result<(), std::fmt::Error> {
    match s.kind {
        MetricKind::Counter => ConstCounter::new(s.value).encode(m),
        MetricKind::Gauge | MetricKind::Histogram => ConstGauge::new(s.value).encode(m),
    }
}

/// Prometheus text of `samples` alone (a PD node's `/metrics`).
pub fn encode_samples(samples: Vec<MetricSample>) -> String {
    let mut registry = Registry::default();
    let c = std::sync::Arc::new(SamplesCollector {
        samples: Mutex::new(samples),
    });
    registry.register_collector(Box::new(c));
    let mut out = String::with_capacity(4096);
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        tracing::error!("cannot encode metrics: {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Family = Family::counter("t_a_total", "a");
    const B: Family = Family::gauge("t_b", "b").with_labels(&["k"]);

    #[test]
    fn an_undeclared_or_twice_declared_family_is_found() {
        assert!(check(&[&[A, B]], &[A.sample(1.0), B.sample(2.0).label("k", "v")]).is_ok());
        let stray = MetricSample::gauge("t_stray", "x", 1.0);
        assert!(check(&[&[A, B]], &[stray])
            .unwrap_err()
            .contains("not declared"));
        assert!(check(&[&[A], &[A]], &[]).unwrap_err().contains("twice"));
        // Wrong labels, wrong kind or help, a counter not ending in _total.
        assert!(check(&[&[A, B]], &[B.sample(1.0)]).is_err());
        let gauge_a = MetricSample::gauge("t_a_total", "a", 1.0);
        assert!(check(&[&[A]], &[gauge_a]).is_err());
        let bad = Family::counter("t_c", "c");
        assert!(check(&[&[bad]], &[]).is_err());
        // A gateway's `node` label on a node's sample is allowed.
        assert!(check(&[&[A]], &[A.sample(1.0).label("node", "d0")]).is_ok());
    }
}
