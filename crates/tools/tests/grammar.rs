//! The formats' grammars, run by llguidance over a byte vocabulary: what
//! they let a model write and what they stop.

use grammar::{Compiler, Limits, Vocabulary};
use request::{GrammarSpec, Scope, TenantId};
use serde_json::json;
use tools::{Choice, Format, Markers, Tool, ToolSet};

const EOS: u32 = 256;
/// A special token standing for `<tool_call>` (as in Qwen's vocabulary).
const OPEN_TOKEN: u32 = 257;

fn compiler() -> Compiler {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    words.push(b"<eos>".to_vec());
    words.push(b"<tool_call>".to_vec());
    let vocab = Vocabulary::from_words(words, &[EOS, OPEN_TOKEN], &[EOS]).unwrap();
    Compiler::new(vocab, Limits::default()).unwrap()
}

fn set(choice: Choice, parallel: bool) -> ToolSet {
    ToolSet {
        tools: vec![
            Tool::new(
                "get_weather",
                Some("Weather in a city".into()),
                json!({"type": "object", "properties": {"city": {"type": "string"},
                       "unit": {"enum": ["c", "f"]}}, "required": ["city"]}),
            ),
            Tool::new("now", None, json!({"type": "object", "properties": {}})),
        ],
        choice,
        parallel,
    }
}

/// How far the grammar lets `tokens` go: `Ok(true)` all of them and may
/// end there, `Ok(false)` all but may not end, `Err(i)` token i refused.
fn walk(c: &Compiler, g: &str, tokens: &[u32]) -> Result<bool, usize> {
    let compiled = c
        .compile(
            Scope::tenant(TenantId(1)),
            &GrammarSpec::Lark(g.to_string()),
        )
        .unwrap_or_else(|e| panic!("{e}\n{g}"));
    let mut m = compiled.matcher();
    for (i, &t) in tokens.iter().enumerate() {
        if m.is_stopped() || !m.mask().unwrap().allows(t) {
            return Err(i);
        }
        m.consume(t).unwrap();
    }
    Ok(m.is_stopped() || m.mask().unwrap().allows(EOS))
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

const CALL: &str = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";

#[test]
fn hermes_auto_leaves_prose_free_and_holds_a_started_call() {
    let c = compiler();
    let g = Format::Hermes
        .grammar(&set(Choice::Auto, true), &Markers::default())
        .unwrap()
        .unwrap();
    assert_eq!(
        walk(&c, &g, &bytes("Just prose, {braces} and <tool_ too.")),
        Ok(true)
    );
    assert_eq!(walk(&c, &g, &bytes("")), Ok(true));
    let call = format!("Let me see.<tool_call>\n{CALL}\n</tool_call>");
    assert_eq!(walk(&c, &g, &bytes(&call)), Ok(true));
    let two =
        format!("{call}\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>");
    assert_eq!(walk(&c, &g, &bytes(&two)), Ok(true));
    // After the trigger: only a declared tool, only its schema.
    let bad_name = "x<tool_call>\n{\"name\": \"rm\"";
    assert!(walk(&c, &g, &bytes(bad_name)).is_err());
    let bad_args = "x<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\"";
    assert!(walk(&c, &g, &bytes(bad_args)).is_err());
    let missing = "x<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}";
    assert!(walk(&c, &g, &bytes(missing)).is_err(), "city is required");
    // A started call must be finished: the output cannot end inside it.
    assert_eq!(
        walk(&c, &g, &bytes("x<tool_call>\n{\"name\": \"now\"")),
        Ok(false)
    );
    // Prose after the calls is not allowed.
    assert!(walk(&c, &g, &bytes(&format!("{call} and more"))).is_err());
}

#[test]
fn required_and_named_choices_admit_only_calls() {
    let c = compiler();
    let g = Format::Hermes
        .grammar(&set(Choice::Required, false), &Markers::default())
        .unwrap()
        .unwrap();
    assert!(walk(&c, &g, &bytes("Sure")).is_err());
    let one = format!("<tool_call>\n{CALL}\n</tool_call>");
    assert_eq!(walk(&c, &g, &bytes(&one)), Ok(true));
    // parallel_tool_calls: false allows one call.
    assert!(walk(&c, &g, &bytes(&format!("{one}\n<tool_call>"))).is_err());
    let g = Format::Hermes
        .grammar(&set(Choice::Named("now".into()), true), &Markers::default())
        .unwrap()
        .unwrap();
    assert!(
        walk(&c, &g, &bytes(&one)).is_err(),
        "only `now` may be called"
    );
    assert_eq!(
        walk(
            &c,
            &g,
            &bytes("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>")
        ),
        Ok(true)
    );
}

#[test]
fn a_special_token_trigger_is_the_token_not_its_text() {
    let c = compiler();
    let markers = Markers {
        special: vec![("<tool_call>".into(), OPEN_TOKEN)],
    };
    let g = Format::Hermes
        .grammar(&set(Choice::Auto, true), &markers)
        .unwrap()
        .unwrap();
    // The text is prose; the token starts a call.
    assert_eq!(walk(&c, &g, &bytes("a <tool_call> b")), Ok(true));
    let mut t = bytes("ok");
    t.push(OPEN_TOKEN);
    t.extend(bytes(&format!("\n{CALL}\n</tool_call>")));
    assert_eq!(walk(&c, &g, &t), Ok(true));
    let mut t = vec![OPEN_TOKEN];
    t.extend(bytes("hello"));
    assert!(walk(&c, &g, &t).is_err());
}

#[test]
fn generic_calls_are_one_json_object_and_prose_does_not_open_with_a_brace() {
    let c = compiler();
    let g = Format::Generic
        .grammar(&set(Choice::Auto, true), &Markers::default())
        .unwrap()
        .unwrap();
    assert_eq!(walk(&c, &g, &bytes("It is sunny {really}.")), Ok(true));
    let env = format!("{{\"tool_calls\": [{CALL}, {{\"name\": \"now\", \"arguments\": {{}}}}]}}");
    assert_eq!(walk(&c, &g, &bytes(&env)), Ok(true));
    assert!(walk(&c, &g, &bytes("{\"answer\"")).is_err());
    let g = Format::Generic
        .grammar(&set(Choice::Required, false), &Markers::default())
        .unwrap()
        .unwrap();
    assert!(walk(&c, &g, &bytes("It")).is_err());
    assert!(walk(&c, &g, &bytes(&env)).is_err(), "one call only");
    assert_eq!(
        walk(&c, &g, &bytes(&format!("{{\"tool_calls\": [{CALL}]}}"))),
        Ok(true)
    );
    // No tools active: no grammar.
    assert_eq!(
        Format::Generic
            .grammar(&set(Choice::None, true), &Markers::default())
            .unwrap(),
        None
    );
}

#[test]
fn grammars_apply_after_the_thought() {
    use tools::ReasoningFormat;
    let c = compiler();
    let calls = Format::Hermes
        .grammar(&set(Choice::Required, false), &Markers::default())
        .unwrap()
        .unwrap();
    let call = format!("<tool_call>\n{CALL}\n</tool_call>");
    // Opened by the prompt: free thought, `</think>`, then only the call.
    let g = ReasoningFormat::Think.after_thought(&calls, true).unwrap();
    assert_eq!(
        walk(
            &c,
            &g,
            &bytes(&format!(
                "Paris, so {{weather}} <tool_call>.</think>\n\n{call}"
            ))
        ),
        Ok(true)
    );
    assert!(
        walk(&c, &g, &bytes("hmm</think>\n\nSure")).is_err(),
        "the answer is held"
    );
    assert_eq!(
        walk(&c, &g, &bytes("still thinking")),
        Ok(false),
        "the thought must end"
    );
    // Not opened: the model may think first, or answer at once.
    let g = ReasoningFormat::Think.after_thought(&calls, false).unwrap();
    assert_eq!(walk(&c, &g, &bytes(&call)), Ok(true));
    assert_eq!(
        walk(&c, &g, &bytes(&format!("<think>ok</think>{call}"))),
        Ok(true)
    );
    assert!(walk(&c, &g, &bytes("Sure")).is_err());
    assert_eq!(ReasoningFormat::None.after_thought(&calls, true), None);
    // A structured output's spec as Lark, wrapped the same way.
    for (spec, good, bad) in [
        (
            GrammarSpec::JsonSchema {
                schema:
                    r#"{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}"#
                        .into(),
                strict: true,
            },
            r#"{"a": 5}"#,
            r#"{"b""#,
        ),
        (GrammarSpec::Regex("[a-c]+/x".into()), "abc/x", "d"),
        (
            GrammarSpec::Choice(vec!["yes".into(), "no \"way\"".into()]),
            "no \"way\"",
            "maybe",
        ),
        (GrammarSpec::JsonObject, r#"{"k": [1]}"#, "[1]"),
    ] {
        let lark = grammar::as_lark(&spec).unwrap().unwrap();
        let g = ReasoningFormat::Think.after_thought(&lark, true).unwrap();
        assert_eq!(
            walk(&c, &g, &bytes(&format!("think</think> {good}"))),
            Ok(true),
            "{spec:?}"
        );
        assert!(
            walk(&c, &g, &bytes(&format!("think</think>{bad}"))).is_err(),
            "{spec:?}"
        );
    }
    assert_eq!(
        grammar::as_lark(&GrammarSpec::Lark("start: \"x\"".into())).unwrap(),
        None
    );
}

/// A tool schema's own references point into its own root, which is not
/// the root once the schema sits in a call (the corpus found it).
#[test]
fn references_inside_a_tool_schema_still_resolve() {
    let c = compiler();
    let order = Tool::new(
        "order",
        None,
        json!({"type": "object", "$defs": {"item": {"type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 6}}, "required": ["sku"]}},
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                           "again": {"$ref": "#/properties/items"}},
            "required": ["items"]}),
    );
    for format in [Format::Generic, Format::Hermes] {
        let s = ToolSet {
            tools: vec![set(Choice::Auto, true).tools[0].clone(), order.clone()],
            choice: Choice::Required,
            parallel: false,
        };
        let g = format.grammar(&s, &Markers::default()).unwrap().unwrap();
        let call = r#"{"name": "order", "arguments": {"items": [{"sku": "AB1"}], "again": []}}"#;
        let text = match format {
            Format::Generic => format!("{{\"tool_calls\": [{call}]}}"),
            _ => format!("<tool_call>\n{call}\n</tool_call>"),
        };
        assert_eq!(walk(&c, &g, &bytes(&text)), Ok(true), "{format:?}");
        let bad = r#"{"name": "order", "arguments": {"items": [{"x""#;
        let bad = match format {
            Format::Generic => format!("{{\"tool_calls\": [{bad}"),
            _ => format!("<tool_call>\n{bad}"),
        };
        assert!(walk(&c, &g, &bytes(&bad)).is_err(), "{format:?}");
    }
}

#[test]
fn llama3_and_mistral_grammars_hold_their_calls() {
    let c = compiler();
    let llama = |choice, parallel| {
        Format::Llama3
            .grammar(&set(choice, parallel), &Markers::default())
            .unwrap()
            .unwrap()
    };
    let call = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    let g = llama(Choice::Auto, true);
    assert_eq!(walk(&c, &g, &bytes("No call here.")), Ok(true));
    assert_eq!(
        walk(
            &c,
            &g,
            &bytes(&format!(
                "{call}; {{\"name\": \"now\", \"parameters\": {{}}}}"
            ))
        ),
        Ok(true)
    );
    assert!(
        walk(&c, &g, &bytes("{\"name\": \"get_weather\", \"arguments\"")).is_err(),
        "Llama's key is parameters"
    );
    let g = llama(Choice::Required, false);
    assert!(walk(&c, &g, &bytes("No")).is_err());
    assert!(
        walk(&c, &g, &bytes(&format!("{call}; "))).is_err(),
        "one call only"
    );
    assert_eq!(walk(&c, &g, &bytes(call)), Ok(true));
    let mistral = |choice| {
        Format::Mistral
            .grammar(&set(choice, true), &Markers::default())
            .unwrap()
            .unwrap()
    };
    let list = "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]";
    let g = mistral(Choice::Auto);
    assert_eq!(walk(&c, &g, &bytes("Plain [TOOL prose")), Ok(true));
    assert_eq!(
        walk(&c, &g, &bytes(&format!("Let me check.{list}"))),
        Ok(true)
    );
    assert!(
        walk(&c, &g, &bytes("x[TOOL_CALLS]{")).is_err(),
        "a list follows the marker"
    );
    let g = mistral(Choice::Named("now".into()));
    assert_eq!(walk(&c, &g, &bytes(list)), Ok(true));
    assert!(walk(&c, &g, &bytes("[TOOL_CALLS][{\"name\": \"get_weather\"")).is_err());
    // Detection from a template's text.
    assert_eq!(Format::detect("{{ '[TOOL_CALLS]' }}"), Format::Mistral);
    assert_eq!(Format::detect("{{ '<|python_tag|>' }}"), Format::Llama3);
    assert_eq!(Format::detect("<tool_call>"), Format::Hermes);
    assert_eq!(Format::detect("{{ m.content }}"), Format::Generic);
}

#[test]
fn gemma_python_calls_hold_their_arguments() {
    let c = compiler();
    let mut s = set(Choice::Required, true);
    s.tools.push(Tool::new(
        "flags",
        None,
        json!({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer"},
               "c": {"type": "string", "maxLength": 3}}, "required": ["b"]}),
    ));
    let g = Format::Gemma
        .grammar(&s, &Markers::default())
        .unwrap()
        .unwrap();
    for ok in [
        r#"[get_weather(city="Paris")]"#,
        r#"[get_weather(city="Oslo", unit="c"), now()]"#,
        r#"[flags(b=3)]"#,
        r#"[flags(a=True, b=-1, c="xy")]"#,
        r#"[flags(b=0, c="z")]"#,
    ] {
        assert_eq!(walk(&c, &g, &bytes(ok)), Ok(true), "{ok}");
    }
    for bad in [
        r#"[get_weather(unit="c")]"#, // city is required
        r#"[flags(a=true"#,           // Python's True
        r#"[flags(c="x", b=1)]"#,     // the schema's order
        r#"[rm("#,
        "Sure",
    ] {
        assert!(
            matches!(walk(&c, &g, &bytes(bad)), Err(_) | Ok(false)),
            "{bad}"
        );
    }
    let g = Format::Gemma
        .grammar(&set(Choice::Auto, true), &Markers::default())
        .unwrap()
        .unwrap();
    assert_eq!(walk(&c, &g, &bytes("It is sunny.")), Ok(true));
    assert_eq!(walk(&c, &g, &bytes("[now()]")), Ok(true));
    assert_eq!(Format::detect("{{ '<start_of_turn>user' }}"), Format::Gemma);
}
