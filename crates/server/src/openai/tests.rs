//! The endpoints' parsers and shapes, together (they share the common
//! fields).

use serde_json::{json, Map, Value};

use super::chat::*;
use super::completions::*;
use super::fields::*;
use super::models::*;
use super::responses::*;
use super::*;
use crate::error::ApiError;

fn chat(v: Value) -> Result<GenParams, ApiError> {
    parse_chat(v.to_string().as_bytes())
}

fn completion(v: Value) -> Result<GenParams, ApiError> {
    parse_completion(v.to_string().as_bytes())
}

fn msgs() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

/// The error of `chat` with `field: value` added names `param`.
fn chat_err(field: &str, value: Value, param: &str) {
    let mut body = json!({"model": "m", "messages": msgs()});
    body[field] = value.clone();
    let e = chat(body).expect_err(&format!("{field} = {value} must fail"));
    assert_eq!(e.status.as_u16(), 400, "{field} = {value}");
    assert_eq!(e.param.as_deref(), Some(param), "{field} = {value}: {e}");
    assert_eq!(e.kind, "invalid_request_error");
}

#[test]
fn defaults_of_a_minimal_chat_request() {
    let p = chat(json!({"model": "m", "messages": msgs()})).expect("valid");
    assert_eq!(p.input, Input::Chat(vec![Message::text("user", "hi")]));
    assert_eq!(p.model.as_deref(), Some("m"));
    assert_eq!(p.max_tokens, None);
    assert_eq!(p.temperature, 1.0);
    assert_eq!((p.top_p, p.top_k, p.min_p), (1.0, 0, 0.0));
    assert_eq!(p.repetition_penalty, 1.0);
    assert_eq!(p.seed, None);
    assert!(!p.stream && !p.include_usage && !p.ignore_eos);
    assert_eq!(p.logprobs, None);
    assert!(p.stop.is_empty());
}

#[test]
fn every_field_is_read() {
    let p = chat(json!({
        "model": "m", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null}
        ],
        "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
        "top_k": 3, "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -1,
        "repetition_penalty": 1.2, "seed": -1, "stop": ["x", "y"], "stream": true,
        "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 4,
        "ignore_eos": true, "user": "u", "some_future_field": {"x": 1}, "n": 1
    }))
    .expect("valid");
    assert_eq!(
        p.input,
        Input::Chat(vec![
            Message::text("system", "be brief"),
            Message::text("user", "a\nb"),
            Message {
                content: None,
                ..Message::text("assistant", "")
            }
        ])
    );
    assert_eq!(p.max_tokens, Some(7), "max_completion_tokens wins");
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p),
        (0.0, 0.5, 3, 0.1)
    );
    assert_eq!((p.presence_penalty, p.frequency_penalty), (1.0, -1.0));
    assert_eq!(p.repetition_penalty, 1.2);
    assert_eq!(p.seed, Some(u64::MAX));
    assert_eq!(p.stop, vec!["x".to_string(), "y".to_string()]);
    assert!(p.stream && p.include_usage && p.ignore_eos);
    assert_eq!(p.logprobs, Some(4));
}

#[test]
fn wrong_types_name_the_field() {
    for (field, value) in [
        ("max_tokens", json!("x")),
        ("max_tokens", json!(1.5)),
        ("max_completion_tokens", json!(true)),
        ("temperature", json!("hot")),
        ("top_p", json!([])),
        ("top_k", json!(1.5)),
        ("min_p", json!({})),
        ("presence_penalty", json!("0")),
        ("frequency_penalty", json!(false)),
        ("repetition_penalty", json!("1")),
        ("seed", json!("42")),
        ("stop", json!(5)),
        ("stream", json!("yes")),
        ("stream_options", json!(1)),
        ("logprobs", json!(1)),
        ("top_logprobs", json!("2")),
        ("ignore_eos", json!(0)),
        ("model", json!(3)),
        ("n", json!("1")),
        ("logit_bias", json!(3)),
        ("messages", json!("hi")),
    ] {
        chat_err(field, value, field);
    }
    chat_err("stop", json!(["a", 1]), "stop[1]");
    chat_err(
        "stream_options",
        json!({"include_usage": 1}),
        "stream_options.include_usage",
    );
    chat_err("messages", json!([1]), "messages[0]");
    chat_err("messages", json!([{"content": "x"}]), "messages[0].role");
    chat_err(
        "messages",
        json!([{"role": 1, "content": "x"}]),
        "messages[0].role",
    );
    chat_err(
        "messages",
        json!([{"role": "user", "content": 5}]),
        "messages[0].content",
    );
    chat_err(
        "messages",
        json!([{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        "messages[0].content[0].text",
    );
    chat_err(
        "messages",
        json!([{"role": "user", "content": [{"text": "x"}]}]),
        "messages[0].content[0].type",
    );
}

fn responses(v: Value) -> Result<GenParams, ApiError> {
    parse_responses(v.to_string().as_bytes())
}

#[test]
fn a_responses_body_becomes_a_conversation() {
    let p = responses(json!({"input": "hi", "instructions": "be brief",
                             "max_output_tokens": 9, "temperature": 0.5}))
    .expect("valid");
    assert_eq!(
        p.input,
        Input::Chat(vec![
            Message::text("system", "be brief"),
            Message::text("user", "hi")
        ])
    );
    assert_eq!((p.max_tokens, p.temperature, p.n), (Some(9), 0.5, 1));
    assert_eq!(p.logprobs, None);
    let p = responses(json!({"input": [
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}
    ], "max_tokens": 3, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}))
    .expect("valid");
    assert_eq!(
        p.input,
        Input::Chat(vec![
            Message::text("system", "sys"),
            Message::text("user", "a"),
            Message::text("assistant", "b")
        ])
    );
    assert_eq!(p.max_tokens, None, "max_tokens is not a Responses field");
    assert_eq!(p.logprobs, Some(2));
    for (body, param) in [
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [1]}), "input[0]"),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        // A past thought alone is no input.
        (json!({"input": [{"type": "reasoning"}]}), "input"),
        (
            json!({"input": [{"type": "web_search_call"}]}),
            "input[0].type",
        ),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"input": "x", "conversation": "c"}), "conversation"),
        (json!({"input": "x", "background": true}), "background"),
        (json!({"input": "x", "n": 2}), "n"),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
            "text.format.name",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
            "text.format.schema",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
            "text.format.type",
        ),
        (
            json!({"input": "x", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"input": "x", "text": 1}), "text"),
        (
            json!({"input": "x", "include": ["file_search_call.results"]}),
            "include[0]",
        ),
        (json!({"input": "x", "include": "x"}), "include"),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
    ] {
        let e = responses(body.clone()).expect_err(&body.to_string());
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
    responses(
        json!({"input": "x", "text": {"format": {"type": "text"}}, "store": false,
                     "metadata": {"k": "v"}, "tool_choice": "none"}),
    )
    .expect("their off values pass");
}

#[test]
fn n_choices_are_read_and_bounded() {
    assert_eq!(chat(json!({"messages": msgs()})).expect("valid").n, 1);
    let p = chat(json!({"messages": msgs(), "n": 3, "best_of": 3})).expect("valid");
    assert_eq!(p.n, 3);
    let p = completion(json!({"prompt": "x", "n": CHOICES_MAX})).expect("valid");
    assert_eq!(p.n, CHOICES_MAX);
    let e = completion(json!({"prompt": "x", "n": 2, "best_of": 3})).expect_err("ranking");
    assert_eq!(e.param.as_deref(), Some("best_of"));
    let e = completion(json!({"prompt": "x", "n": CHOICES_MAX + 1})).expect_err("too many");
    assert_eq!(e.param.as_deref(), Some("n"));
}

#[test]
fn logit_bias_is_read_sorted_and_bounded() {
    let p = chat(json!({"messages": msgs(), "logit_bias": {"50": -100, "7": 2.5, "0": 100}}))
        .expect("valid");
    assert_eq!(p.logit_bias, vec![(0, 100.0), (7, 2.5), (50, -100.0)]);
    let p = completion(json!({"prompt": "x", "logit_bias": {}})).expect("valid");
    assert!(p.logit_bias.is_empty());
    let p = completion(json!({"prompt": "x", "logit_bias": null})).expect("valid");
    assert!(p.logit_bias.is_empty());
    let many: Map<String, Value> = (0..=request::LOGIT_BIAS_MAX)
        .map(|t| (t.to_string(), json!(1)))
        .collect();
    chat_err("logit_bias", Value::Object(many), "logit_bias");
    chat_err("logit_bias", json!({"1": "5"}), "logit_bias");
}

/// Tools are read into one tool set (OpenAI's and the legacy shape); a
/// malformed tool names the tool and the field; their "off" values pass
/// with nothing active.
#[test]
fn tool_requests_are_read_and_malformed_tools_name_the_field() {
    use ::tools::Choice;
    let f = |name: &str| {
        json!({"type": "function", "function": {"name": name,
        "description": "d", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    };
    let mut body = json!({"messages": msgs(), "tools": [f("a"), f("b")]});
    let t = chat(body.clone()).expect("valid").tools.expect("tools");
    assert_eq!(
        (t.set.tools.len(), &t.set.choice, t.set.parallel, t.legacy),
        (2, &Choice::Auto, true, false)
    );
    assert_eq!(t.set.tools[1].name, "b");
    assert_eq!(t.declared[0], f("a"), "the template sees the tool as sent");
    body["tool_choice"] = json!({"type": "function", "function": {"name": "b"}});
    body["parallel_tool_calls"] = json!(false);
    let t = chat(body.clone()).expect("valid").tools.expect("tools");
    assert_eq!(
        (t.set.choice, t.set.parallel),
        (Choice::Named("b".into()), false)
    );
    body["tool_choice"] = json!("required");
    assert_eq!(
        chat(body).expect("valid").tools.expect("tools").set.choice,
        Choice::Required
    );
    // The legacy shape.
    let t = chat(
        json!({"messages": msgs(), "functions": [{"name": "g"}], "function_call": {"name": "g"}}),
    )
    .expect("valid")
    .tools
    .expect("tools");
    assert_eq!(
        (t.legacy, t.set.choice, t.set.parallel),
        (true, Choice::Named("g".into()), false)
    );
    assert_eq!(
        t.set.tools[0].parameters,
        json!({"type": "object", "properties": {}})
    );
    for (field, value, param) in [
        ("tools", json!({}), "tools"),
        ("tools", json!([1]), "tools[0]"),
        ("tools", json!([{"type": "function"}]), "tools[0].function"),
        ("tools", json!([{"type": "web_search"}]), "tools[0].type"),
        (
            "tools",
            json!([{"type": "function", "function": {}}]),
            "tools[0].function.name",
        ),
        ("tools", json!([f("a b")]), "tools[0].function.name"),
        (
            "tools",
            json!([f(&"x".repeat(65))]),
            "tools[0].function.name",
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "a", "parameters": "x"}}]),
            "tools[0].function.parameters",
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "a", "description": 1}}]),
            "tools[0].function.description",
        ),
        ("tools", json!([f("a"), f("a")]), "tools[1].function.name"),
        ("tool_choice", json!("required"), "tool_choice"),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
            "tool_choice",
        ),
        ("function_call", json!({"name": "f"}), "function_call"),
        ("parallel_tool_calls", json!(1), "parallel_tool_calls"),
    ] {
        chat_err(field, value, param);
    }
    let with = |extra: Value| {
        let mut body = json!({"messages": msgs(), "tools": [f("a")]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        chat(body)
    };
    for (extra, param) in [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "zz"}}}),
            "tool_choice.function.name",
        ),
        (json!({"tool_choice": "always"}), "tool_choice"),
        (json!({"functions": [{"name": "g"}]}), "functions"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let e = with(extra.clone()).expect_err(&extra.to_string());
        assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e}");
    }
    // An output format beside tools that are off is served.
    assert!(
        with(json!({"tool_choice": "none", "response_format": {"type": "json_object"}})).is_ok()
    );
    let e = completion(json!({"prompt": "x", "tools": [f("a")]})).expect_err("completions");
    assert_eq!(e.param.as_deref(), Some("tools"));
    for (field, value) in [
        ("tools", json!([])),
        ("tools", Value::Null),
        ("tool_choice", json!("none")),
        ("tool_choice", json!("auto")),
        ("function_call", json!("none")),
    ] {
        let mut body = json!({"messages": msgs()});
        body[field] = value.clone();
        let p = chat(body).unwrap_or_else(|e| panic!("{field} = {value}: {e}"));
        assert_eq!((p.structured, p.tools), (None, None));
    }
}

/// The history's calls and results: read with their ids, arguments
/// parsed; a call whose arguments are not JSON names them.
#[test]
fn history_calls_and_tool_results_are_read() {
    let p = chat(json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get", "arguments": "{\"q\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "function", "name": "get", "content": "43"}
    ]}))
    .expect("valid");
    let Input::Chat(m) = p.input else { panic!() };
    assert_eq!(m[1].content, None);
    assert_eq!(m[1].tool_calls[0].id, "call_1");
    assert_eq!(m[1].tool_calls[0].arguments, json!({"q": 1}));
    assert_eq!(
        (m[2].tool_call_id.as_deref(), m[2].content.as_deref()),
        (Some("call_1"), Some("42"))
    );
    assert_eq!(m[3].name.as_deref(), Some("get"));
    for (msg, param) in [
        (
            json!({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "get", "arguments": "{x"}}]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "get", "arguments": "{}"}}]}),
            "messages[1].tool_calls[0].id",
        ),
        (
            json!({"role": "assistant", "tool_calls": {}}),
            "messages[1].tool_calls",
        ),
        (
            json!({"role": "function", "content": "x"}),
            "messages[1].name",
        ),
    ] {
        let e =
            chat(json!({"messages": [{"role": "user", "content": "hi"}, msg]})).expect_err("bad");
        assert_eq!(e.param.as_deref(), Some(param), "{e}");
    }
}

/// Every field that asks for structured output becomes one grammar, and
/// names itself in errors; what the server would not honour is refused.
#[test]
fn structured_output_fields_become_one_grammar() {
    use request::GrammarSpec;
    let schema = json!({"type": "object"});
    let cases = [
        (
            json!({"response_format": {"type": "json_object"}}),
            GrammarSpec::JsonObject,
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "x", "schema": schema, "strict": true}}}),
            GrammarSpec::JsonSchema {
                schema: schema.to_string(),
                strict: true,
            },
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_object", "schema": schema}}),
            GrammarSpec::JsonSchema {
                schema: schema.to_string(),
                strict: false,
            },
            "response_format",
        ),
        (
            json!({"structured_outputs": {"json": schema.to_string()}}),
            GrammarSpec::JsonSchema {
                schema: schema.to_string(),
                strict: false,
            },
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"regex": "a+"}}),
            GrammarSpec::Regex("a+".into()),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"choice": ["a", "b"]}}),
            GrammarSpec::Choice(vec!["a".into(), "b".into()]),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"a\""}}),
            GrammarSpec::Lark("start: \"a\"".into()),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"json_object": true}}),
            GrammarSpec::JsonObject,
            "structured_outputs",
        ),
        (
            json!({"guided_regex": "[0-9]+"}),
            GrammarSpec::Regex("[0-9]+".into()),
            "guided_regex",
        ),
    ];
    for (extra, spec, param) in cases {
        let mut body = json!({"messages": msgs()});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        let p = chat(body.clone()).unwrap_or_else(|e| panic!("{body}: {e}"));
        let s = p.structured.expect("a grammar");
        assert_eq!((s.spec, s.param), (spec.clone(), param), "{body}");
        // Completions read the same fields.
        body.as_object_mut().expect("object").remove("messages");
        body["prompt"] = json!("x");
        let p = completion(body.clone()).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(p.structured.expect("a grammar").spec, spec);
    }
    for (field, value, param) in [
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            "response_format.json_schema.schema",
        ),
        (
            "response_format",
            json!({"type": "json_object", "extra": 1}),
            "response_format.extra",
        ),
        (
            "structured_outputs",
            json!({"regex": "a", "choice": ["b"]}),
            "structured_outputs",
        ),
        ("structured_outputs", json!({}), "structured_outputs"),
        (
            "structured_outputs",
            json!({"whitespace_pattern": " "}),
            "structured_outputs.whitespace_pattern",
        ),
        (
            "structured_outputs",
            json!({"choice": [1]}),
            "structured_outputs.choice[0]",
        ),
        (
            "structured_outputs",
            json!({"regex": "a".repeat(request::constraint::GRAMMAR_BYTES_MAX + 1)}),
            "structured_outputs",
        ),
        (
            "guided_decoding_backend",
            json!("xgrammar"),
            "guided_decoding_backend",
        ),
    ] {
        chat_err(field, value, param);
    }
    // Two fields asking for a grammar: refused, naming the second.
    let e = chat(
        json!({"messages": msgs(), "response_format": {"type": "json_object"},
                        "guided_choice": ["a"]}),
    )
    .expect_err("two grammars");
    assert_eq!(e.param.as_deref(), Some("guided_choice"), "{e}");
    // The Responses API's flat form, echoed back as sent.
    let fmt = json!({"type": "json_schema", "name": "n", "schema": schema, "strict": true});
    let p = responses(json!({"input": "x", "text": {"format": fmt}})).expect("valid");
    let s = p.structured.expect("a grammar");
    assert_eq!(s.param, "text.format");
    assert_eq!(s.format, Some(fmt));
}

#[test]
fn out_of_range_values_name_the_field() {
    for (field, value) in [
        ("max_tokens", json!(0)),
        ("max_tokens", json!(-5)),
        ("max_tokens", json!(u64::MAX)),
        ("temperature", json!(-1)),
        ("temperature", json!(2.5)),
        ("top_p", json!(0)),
        ("top_p", json!(1.1)),
        ("top_k", json!(-2)),
        ("min_p", json!(1.5)),
        ("presence_penalty", json!(3)),
        ("frequency_penalty", json!(-3)),
        ("repetition_penalty", json!(0)),
        ("repetition_penalty", json!(11)),
        ("n", json!(17)),
        ("n", json!(0)),
        ("best_of", json!(2)),
        ("top_logprobs", json!(21)),
        ("logit_bias", json!({"1": 101})),
        ("logit_bias", json!({"1": -100.5})),
        ("logit_bias", json!({"x": 1})),
        ("logit_bias", json!({"-1": 1})),
        ("logit_bias", json!({"+1": 1})),
        ("logit_bias", json!({" 1": 1})),
        ("logit_bias", json!({"4294967296": 1})),
        ("logit_bias", json!({"7": 1, "07": 2})),
        ("stop", json!(["a", "b", "c", "d", "e"])),
        ("stop", json!("")),
        ("stop", json!("x".repeat(300))),
        ("messages", json!([])),
    ] {
        chat_err(field, value, field);
    }
    // top_logprobs without logprobs
    let e = chat(json!({"messages": msgs(), "top_logprobs": 2})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    chat_err(
        "messages",
        json!([{"role": "wizard", "content": "x"}]),
        "messages[0].role",
    );
    chat_err(
        "messages",
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].type",
    );
}

#[test]
fn malformed_json_and_missing_fields() {
    for body in [&b"{"[..], b"", b"[1]", b"\"x\"", b"{\"a\":}", b"\xff\xfe"] {
        let e = parse_chat(body).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.code, Some("invalid_json"));
        assert_eq!(e.param, None);
    }
    let e = chat(json!({"model": "m"})).unwrap_err();
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("messages"), Some("missing_required_parameter"))
    );
    let e = completion(json!({"model": "m"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt"));
    // Deep nesting is refused by serde_json's recursion limit, not a crash.
    let deep = "[".repeat(100_000);
    assert!(parse_chat(deep.as_bytes()).is_err());
}

#[test]
fn completion_prompts() {
    let p = completion(json!({"prompt": "The capital"})).expect("string");
    assert_eq!(p.input, Input::Text("The capital".into()));
    let p = completion(json!({"prompt": ["one"]})).expect("one string");
    assert_eq!(p.input, Input::Text("one".into()));
    let p = completion(json!({"prompt": [1, 2, 3]})).expect("ids");
    assert_eq!(p.input, Input::Tokens(vec![1, 2, 3]));
    let p = completion(json!({"prompt": [[4, 5]]})).expect("one id list");
    assert_eq!(p.input, Input::Tokens(vec![4, 5]));
    let p = completion(json!({"prompt": "x", "logprobs": 3})).expect("logprobs");
    assert_eq!(p.logprobs, Some(3));
    let p = completion(json!({"prompt": ["a", [7, 8], "c"], "n": 2})).expect("a batch");
    assert_eq!(p.input, Input::Text("a".into()));
    assert_eq!(
        p.more_inputs,
        vec![Input::Tokens(vec![7, 8]), Input::Text("c".into())]
    );
    assert_eq!(p.n, 2);
    let many: Vec<Value> = (0..=PROMPTS_MAX).map(|i| json!(i.to_string())).collect();
    for (body, param) in [
        (json!({"prompt": many}), "prompt"),
        (json!({"prompt": ["a", "b", "c", "d", "e"], "n": 16}), "n"),
        (json!({"prompt": ["a", []]}), "prompt[1]"),
        (json!({"prompt": ["a", 3]}), "prompt[1]"),
        (json!({"prompt": [[1], ["x"]]}), "prompt[1][0]"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": [1, -2]}), "prompt[1]"),
        (json!({"prompt": [1, "a"]}), "prompt[1]"),
        (json!({"prompt": [1, 5_000_000_000u64]}), "prompt[1]"),
        (json!({"prompt": [true]}), "prompt[0]"),
        (json!({"prompt": "x", "logprobs": true}), "logprobs"),
        (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "best_of": 2}), "best_of"),
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (json!({"prompt": "x", "n": 17}), "n"),
    ] {
        let e = completion(body.clone()).expect_err(&body.to_string());
        assert_eq!(e.status.as_u16(), 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
    }
}

#[test]
fn chunk_usage_field_is_absent_null_or_set() {
    let mut c = ChatChunk {
        id: "chatcmpl-1".into(),
        object: "chat.completion.chunk".into(),
        created: 1,
        model: "m".into(),
        choices: vec![ChatChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant".into()),
                content: Some(String::new()),
                ..Delta::default()
            },
            logprobs: None,
            finish_reason: None,
        }],
        usage: None,
    };
    let v = serde_json::to_value(&c).expect("ser");
    assert!(v.get("usage").is_none());
    assert_eq!(
        v["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
    c.usage = Some(None);
    let v = serde_json::to_value(&c).expect("ser");
    assert_eq!(v["usage"], Value::Null);
    c.usage = Some(Some(Usage::new(3, 4)));
    c.choices.clear();
    let v = serde_json::to_value(&c).expect("ser");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
               "prompt_tokens_details": {"cached_tokens": 0},
               "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                             "rejected_prediction_tokens": 0}})
    );
    assert_eq!(v["choices"], json!([]));
}

#[test]
fn response_shapes_round_trip() {
    let resp = ChatCompletion {
        id: "chatcmpl-abc".into(),
        object: "chat.completion".into(),
        created: 1_700_000_000,
        model: "SmolLM2".into(),
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessageOut {
                role: "assistant".into(),
                content: Some("Paris".into()),
                reasoning_content: None,
                reasoning: None,
                tool_calls: None,
                function_call: None,
            },
            logprobs: Some(ChatLogprobs {
                content: vec![TokenLogprob {
                    token: "Paris".into(),
                    logprob: -0.25,
                    bytes: b"Paris".to_vec(),
                    top_logprobs: vec![TopLogprob {
                        token: " Lyon".into(),
                        logprob: -3.5,
                        bytes: b" Lyon".to_vec(),
                    }],
                }],
            }),
            finish_reason: Some("stop".into()),
        }],
        usage: Usage::new(10, 2),
    };
    let text = serde_json::to_string(&resp).expect("ser");
    let back: ChatCompletion = serde_json::from_str(&text).expect("de");
    assert_eq!(back, resp);
    let v: Value = serde_json::from_str(&text).expect("value");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris");
    assert_eq!(v["usage"]["total_tokens"], 12);

    let mut top = Map::new();
    top.insert(" Paris".into(), json!(-0.5));
    let comp = Completion {
        id: "cmpl-abc".into(),
        object: "text_completion".into(),
        created: 1,
        model: "m".into(),
        choices: vec![CompletionChoice {
            index: 0,
            text: " Paris".into(),
            logprobs: Some(CompletionLogprobs {
                tokens: vec![" Paris".into()],
                token_logprobs: vec![-0.5],
                top_logprobs: vec![top],
                text_offset: vec![0],
            }),
            finish_reason: Some("length".into()),
        }],
        usage: Some(Some(Usage::new(5, 1))),
    };
    let text = serde_json::to_string(&comp).expect("ser");
    assert_eq!(serde_json::from_str::<Completion>(&text).expect("de"), comp);

    let models = ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: "m".into(),
            object: "model".into(),
            created: 1,
            owned_by: "isoserve".into(),
            max_model_len: 8192,
            context_length: 8192,
        }],
    };
    let text = serde_json::to_string(&models).expect("ser");
    assert_eq!(
        serde_json::from_str::<ModelList>(&text).expect("de"),
        models
    );
}

#[test]
fn error_body_is_openai_shaped() {
    let e = ApiError::invalid_type("max_tokens", "an integer, got string");
    let v = serde_json::to_value(e.body()).expect("ser");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "max_tokens");
    assert_eq!(v["error"]["code"], "invalid_type");
    assert!(v["error"]["message"]
        .as_str()
        .expect("msg")
        .contains("max_tokens"));
    let back: crate::error::ErrorBody = serde_json::from_value(v).expect("de");
    assert_eq!(back, e.body());
    let ctx = ApiError::from_engine(
        &request::RequestError::ContextLengthExceeded {
            prompt: 900,
            max_tokens: 200,
            total: 1100,
            limit: 1024,
        },
        "messages",
        "top_logprobs",
    );
    assert_eq!(ctx.code, Some("context_length_exceeded"));
    assert!(ctx.message.contains("1024") && ctx.message.contains("1100"));
    assert_eq!(ctx.param.as_deref(), Some("messages"));
}

#[test]
fn a_huge_number_is_shown_short_in_an_error() {
    let body = br#"{"prompt": "x", "temperature": 1e300}"#;
    let e = parse_completion(body).expect_err("out of range");
    assert_eq!(e.param.as_deref(), Some("temperature"));
    assert!(e.message.len() < 120, "{}", e.message);
    assert!(e.message.contains("1e300"), "{}", e.message);
    assert_eq!(shown_number(0.5), "0.5");
    assert_eq!(shown_number(-3.0), "-3");
}

/// `prediction` (Predicted Outputs): a string or text parts, joined; every
/// malformed shape names its field; refused with `n` above 1, `logprobs`,
/// `tools` and an output format, as `unsupported_parameter`.
#[test]
fn a_prediction_is_read_and_refused_where_it_cannot_be_honoured() {
    let with = |extra: Value| {
        let mut body = json!({"messages": msgs()});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        chat(body)
    };
    let p = with(json!({"prediction": {"type": "content", "content": "fn main() {}"}})).unwrap();
    assert_eq!(p.prediction.as_deref(), Some("fn main() {}"));
    let parts = json!({"prediction": {"type": "content", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}});
    assert_eq!(with(parts).unwrap().prediction.as_deref(), Some("ab"));
    assert_eq!(with(json!({"prediction": null})).unwrap().prediction, None);
    for (value, param) in [
        (json!("x"), "prediction"),
        (json!({"content": "x"}), "prediction.type"),
        (json!({"type": "text", "content": "x"}), "prediction.type"),
        (json!({"type": 1, "content": "x"}), "prediction.type"),
        (json!({"type": "content"}), "prediction.content"),
        (
            json!({"type": "content", "content": 3}),
            "prediction.content",
        ),
        (
            json!({"type": "content", "content": ["x"]}),
            "prediction.content[0]",
        ),
        (
            json!({"type": "content", "content": [{"type": "image_url", "text": "x"}]}),
            "prediction.content[0].type",
        ),
        (
            json!({"type": "content", "content": [{"type": "text"}]}),
            "prediction.content[0].text",
        ),
        (
            json!({"type": "content", "content": [{"type": "text", "text": 1}]}),
            "prediction.content[0].text",
        ),
        (
            json!({"type": "content", "content": "x".repeat(PREDICTION_BYTES_MAX + 1)}),
            "prediction.content",
        ),
    ] {
        chat_err("prediction", value, param);
    }
    let pred = json!({"type": "content", "content": "x"});
    for (extra, param) in [
        (json!({"n": 2}), "n"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"logprobs": true, "top_logprobs": 2}), "logprobs"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let mut extra = extra;
        extra["prediction"] = pred.clone();
        let e = with(extra.clone()).expect_err(&extra.to_string());
        assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e}");
        assert_eq!(e.code, Some("unsupported_parameter"), "{extra}");
        assert_eq!(e.status.as_u16(), 400);
    }
    // Each of those fields alone is served, and so is `n: 1`.
    assert!(with(json!({"n": 2})).is_ok());
    assert!(with(json!({"n": 1, "prediction": pred})).is_ok());
}
