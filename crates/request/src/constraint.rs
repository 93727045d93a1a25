//! Output constraints (structured outputs): the grammar a request's output
//! must follow, as the request asked for it ([`GrammarSpec`], plain data
//! that crosses the PD wire), and its compiled form where a process
//! compiled it ([`Constraint::compiled`], opaque here: the `grammar`
//! crate's). The vocabulary knows no grammar engine: it bounds the text
//! and carries it.

use std::any::Any;
use std::sync::Arc;

/// Most bytes of a grammar's source: a JSON schema's text, a regex, a Lark
/// grammar, or the choices together. Past it a request is refused before
/// anything is compiled (a 100 KiB schema is still served).
pub const GRAMMAR_BYTES_MAX: usize = 128 << 10;
/// Most choices of a `choice` constraint.
pub const GRAMMAR_CHOICES_MAX: usize = 1024;

/// What the output must be: one of the forms the APIs ask for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under a JSON Schema: its text, as sent (`strict` is
    /// OpenAI's flag; both are enforced the same way, by construction).
    JsonSchema { schema: String, strict: bool },
    /// Text matching a regular expression, anchored at both ends.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl GrammarSpec {
    /// The kind's name, as vLLM's `structured_outputs` keys name it.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::JsonSchema { .. } => "json",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// Bytes of source text (what [`GRAMMAR_BYTES_MAX`] bounds).
    pub fn source_bytes(&self) -> usize {
        match self {
            GrammarSpec::JsonObject => 0,
            GrammarSpec::JsonSchema { schema, .. } => schema.len(),
            GrammarSpec::Regex(s) | GrammarSpec::Lark(s) => s.len(),
            GrammarSpec::Choice(c) => c.iter().map(String::len).sum(),
        }
    }

    /// The bounds every node checks before compiling anything.
    pub fn check_bounds(&self) -> Result<(), String> {
        let n = self.source_bytes();
        if n > GRAMMAR_BYTES_MAX {
            return Err(format!(
                "the {} is {n} bytes: at most {GRAMMAR_BYTES_MAX} are accepted",
                self.noun()
            ));
        }
        if let GrammarSpec::Choice(c) = self {
            if c.is_empty() || c.len() > GRAMMAR_CHOICES_MAX {
                return Err(format!(
                    "a choice needs 1 to {GRAMMAR_CHOICES_MAX} strings, got {}",
                    c.len()
                ));
            }
            if c.iter().any(String::is_empty) {
                return Err("a choice may not be the empty string".into());
            }
        }
        Ok(())
    }

    /// What the source is, for messages ("schema", "regex", ...).
    pub fn noun(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema { .. } => "schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice list",
            GrammarSpec::Lark(_) => "grammar",
        }
    }
}

/// A request's output constraint: the spec and, in the process that
/// checked the request, its compiled form. A process that receives only
/// the spec (a PD node) compiles it in its own cache.
#[derive(Clone)]
pub struct Constraint {
    pub spec: Arc<GrammarSpec>,
    /// The `grammar` crate's compiled grammar, made in this request's
    /// cache scope (K11); `None`: not compiled here yet.
    pub compiled: Option<Arc<dyn Any + Send + Sync>>,
}

impl Constraint {
    /// A constraint not compiled yet.
    pub fn new(spec: GrammarSpec) -> Constraint {
        Constraint {
            spec: Arc::new(spec),
            compiled: None,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.spec.kind())
            .field("source_bytes", &self.spec.source_bytes())
            .field("compiled", &self.compiled.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_name_the_limit() {
        let big = GrammarSpec::Regex("a".repeat(GRAMMAR_BYTES_MAX + 1));
        assert!(big.check_bounds().unwrap_err().contains("regex"));
        assert!(GrammarSpec::Regex("a".repeat(GRAMMAR_BYTES_MAX))
            .check_bounds()
            .is_ok());
        assert!(GrammarSpec::Choice(vec![]).check_bounds().is_err());
        assert!(GrammarSpec::Choice(vec!["".into()]).check_bounds().is_err());
        let many = GrammarSpec::Choice(vec!["x".into(); GRAMMAR_CHOICES_MAX + 1]);
        assert!(many.check_bounds().is_err());
        assert!(GrammarSpec::JsonObject.check_bounds().is_ok());
    }
}
