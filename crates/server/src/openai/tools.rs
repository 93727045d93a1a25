//! Tool calling over OpenAI's API: `tools`, `tool_choice`,
//! `parallel_tool_calls` and the legacy `functions`/`function_call`
//! parsed (a malformed tool is a 400 naming the tool and the field); the
//! history's calls and results rendered for the model's format (the
//! template's own, or the generic fallback's system message); the call
//! grammar compiled in the request's cache scope (K11). The output side
//! (calls parsed from the text) is `chat`'s shaper, over
//! [`tools::CallParser`].

use std::sync::Arc;

use serde_json::{json, Value};
use tokenizer::{ChatMessage, TemplateValue};
use tools::{Choice, Format, Tool, ToolSet, TOOLS_MAX, TOOL_NAME_BYTES_MAX};

use super::fields::{template_value, type_name, Fields};
use super::{HistoryCall, Message, HISTORY_CALLS_MAX};
use crate::error::ApiError;
use crate::state::AppState;

/// A request's tools, as parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    pub set: ToolSet,
    /// Sent as the legacy `functions`: answered with `function_call`.
    pub legacy: bool,
    /// Each tool as the chat template sees it (`{"type": "function",
    /// "function": {…}}`, as sent).
    pub declared: Vec<Value>,
}

impl ToolRequest {
    /// The field the tools came in (errors name it).
    pub fn param(&self) -> &'static str {
        if self.legacy {
            "functions"
        } else {
            "tools"
        }
    }
}

/// A tool's name as OpenAI bounds it: 1 to 64 of `a-z A-Z 0-9 _ - .`.
fn check_name(name: &str, at: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= TOOL_NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_value(
            at,
            format!(
                "a tool name is 1 to {TOOL_NAME_BYTES_MAX} characters of a-z, A-Z, 0-9, `_`, `-` \
                 and `.`, got {name:?}"
            ),
        ))
    }
}

/// One function definition (`tools[i].function`, or `functions[i]`).
fn parse_function(v: &Value, at: &str) -> Result<Tool, ApiError> {
    let Value::Object(m) = v else {
        return Err(ApiError::invalid_type(
            at,
            &format!("an object, got {}", type_name(v)),
        ));
    };
    let f = Fields(m);
    let name = f
        .string("name")
        .map_err(|_| ApiError::invalid_type(format!("{at}.name"), "a string"))?
        .ok_or_else(|| ApiError::missing(&format!("{at}.name")))?;
    check_name(name, &format!("{at}.name"))?;
    let description = f
        .string("description")
        .map_err(|_| ApiError::invalid_type(format!("{at}.description"), "a string"))?
        .map(str::to_string);
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(p) => {
            return Err(ApiError::invalid_type(
                format!("{at}.parameters"),
                &format!("a JSON schema object, got {}", type_name(p)),
            ))
        }
    };
    let strict = f
        .bool("strict")
        .map_err(|_| ApiError::invalid_type(format!("{at}.strict"), "a boolean"))?
        .unwrap_or(false);
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
        strict,
    })
}

fn array<'a>(f: &'a Fields<'_>, field: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
    match f.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(ApiError::invalid_type(
            field,
            &format!("an array, got {}", type_name(v)),
        )),
    }
}

/// `tools` / `functions` and their choice; `None` when none are declared
/// (a choice of `none` or `auto` alone passes, as OpenAI's does).
pub(crate) fn parse(f: &Fields<'_>) -> Result<Option<ToolRequest>, ApiError> {
    let tools = array(f, "tools")?.filter(|a| !a.is_empty());
    let functions = array(f, "functions")?.filter(|a| !a.is_empty());
    let legacy = match (tools, functions) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_value(
                "functions",
                "send `tools` or the legacy `functions`, not both",
            ))
        }
        (None, Some(_)) => true,
        _ => false,
    };
    let (param, choice_param) = match legacy {
        true => ("functions", "function_call"),
        false => ("tools", "tool_choice"),
    };
    let list = tools.or(functions);
    if list.is_none() {
        // No tools: a choice that asks for a call is an error.
        for field in ["tool_choice", "function_call"] {
            match f.get(field) {
                None | Some(Value::Null) => {}
                Some(Value::String(c)) if c == "none" || c == "auto" => {}
                Some(_) => {
                    return Err(ApiError::invalid_value(
                        field,
                        "a tool choice other than `none` or `auto` needs `tools`",
                    ))
                }
            }
        }
        if f.get("parallel_tool_calls").is_some() {
            f.bool("parallel_tool_calls")?;
        }
        return Ok(None);
    }
    let list = list.expect("checked above");
    if list.len() > TOOLS_MAX {
        return Err(ApiError::invalid_value(
            param,
            format!("at most {TOOLS_MAX} tools, got {}", list.len()),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    let mut declared = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("{param}[{i}]");
        let tool = if legacy {
            declared.push(json!({"type": "function", "function": t}));
            parse_function(t, &at)?
        } else {
            let Value::Object(m) = t else {
                return Err(ApiError::invalid_type(
                    at,
                    &format!("an object, got {}", type_name(t)),
                ));
            };
            let tf = Fields(m);
            match tf.string("type") {
                Ok(Some("function")) | Ok(None) => {}
                Ok(Some(other)) => {
                    return Err(ApiError::unsupported(
                        &format!("{at}.type"),
                        &format!("tools of type `{other}` are not supported (only `function`)"),
                    ))
                }
                Err(_) => return Err(ApiError::invalid_type(format!("{at}.type"), "a string")),
            }
            let func = tf
                .get("function")
                .ok_or_else(|| ApiError::missing(&format!("{at}.function")))?;
            declared.push(t.clone());
            parse_function(func, &format!("{at}.function"))?
        };
        if out.iter().any(|x: &Tool| x.name == tool.name) {
            return Err(ApiError::invalid_value(
                format!("{at}.{}name", if legacy { "" } else { "function." }),
                format!("two tools are named `{}`", tool.name),
            ));
        }
        out.push(tool);
    }
    let choice = match f.get(choice_param) {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" if !legacy => Choice::Required,
            other => {
                return Err(ApiError::invalid_value(
                    choice_param,
                    format!(
                        "`{other}` is not one of {}",
                        if legacy {
                            "none, auto, or {\"name\": …}"
                        } else {
                            "none, auto, required, or {\"type\": \"function\", \"function\": {\"name\": …}}"
                        }
                    ),
                ))
            }
        },
        Some(Value::Object(m)) => {
            let cf = Fields(m);
            let (name, at) = if legacy {
                (cf.string("name"), format!("{choice_param}.name"))
            } else {
                match cf.string("type") {
                    Ok(Some("function")) => {}
                    Ok(Some(other)) => {
                        return Err(ApiError::unsupported(
                            &format!("{choice_param}.type"),
                            &format!("a tool choice of type `{other}` is not supported"),
                        ))
                    }
                    _ => return Err(ApiError::missing(&format!("{choice_param}.type"))),
                }
                let func = match cf.get("function") {
                    Some(Value::Object(fm)) => fm,
                    _ => return Err(ApiError::missing(&format!("{choice_param}.function"))),
                };
                (
                    Fields(func).string("name"),
                    format!("{choice_param}.function.name"),
                )
            };
            let name = name
                .map_err(|_| ApiError::invalid_type(at.clone(), "a string"))?
                .ok_or_else(|| ApiError::missing(&at))?;
            if !out.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid_value(
                    at,
                    format!("`{name}` is not one of the declared tools"),
                ));
            }
            Choice::Named(name.to_string())
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                choice_param,
                &format!("a string or an object, got {}", type_name(v)),
            ))
        }
    };
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(!legacy);
    Ok(Some(ToolRequest {
        set: ToolSet {
            tools: out,
            choice,
            parallel,
        },
        legacy,
        declared,
    }))
}

/// An assistant message's calls (`tool_calls`, or the legacy
/// `function_call`); the arguments must be JSON (the template prints them
/// as an object).
pub(crate) fn parse_history_calls(mf: &Fields<'_>, at: &str) -> Result<Vec<HistoryCall>, ApiError> {
    let mut out = Vec::new();
    let arguments = |v: Option<&Value>, at: &str| -> Result<Value, ApiError> {
        match v {
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                ApiError::invalid_value(at, format!("the arguments are not JSON: {e}"))
            }),
            Some(o @ Value::Object(_)) => Ok(o.clone()),
            None => Err(ApiError::missing(at)),
            Some(v) => Err(ApiError::invalid_type(
                at,
                &format!("a string of JSON, got {}", type_name(v)),
            )),
        }
    };
    match mf.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            if calls.len() > HISTORY_CALLS_MAX {
                return Err(ApiError::invalid_value(
                    format!("{at}.tool_calls"),
                    format!("at most {HISTORY_CALLS_MAX} calls"),
                ));
            }
            for (j, c) in calls.iter().enumerate() {
                let cat = format!("{at}.tool_calls[{j}]");
                let Value::Object(cm) = c else {
                    return Err(ApiError::invalid_type(
                        cat,
                        &format!("an object, got {}", type_name(c)),
                    ));
                };
                let cf = Fields(cm);
                let id = cf
                    .string("id")
                    .map_err(|_| ApiError::invalid_type(format!("{cat}.id"), "a string"))?
                    .ok_or_else(|| ApiError::missing(&format!("{cat}.id")))?;
                match cf.string("type") {
                    Ok(None) | Ok(Some("function")) => {}
                    _ => {
                        return Err(ApiError::unsupported(
                            &format!("{cat}.type"),
                            "only `function` calls are supported",
                        ))
                    }
                }
                let func = match cf.get("function") {
                    Some(Value::Object(fm)) => fm,
                    _ => return Err(ApiError::missing(&format!("{cat}.function"))),
                };
                let ff = Fields(func);
                let name = ff
                    .string("name")
                    .map_err(|_| {
                        ApiError::invalid_type(format!("{cat}.function.name"), "a string")
                    })?
                    .ok_or_else(|| ApiError::missing(&format!("{cat}.function.name")))?;
                check_name(name, &format!("{cat}.function.name"))?;
                let arguments =
                    arguments(ff.get("arguments"), &format!("{cat}.function.arguments"))?;
                out.push(HistoryCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    arguments,
                });
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                format!("{at}.tool_calls"),
                &format!("an array, got {}", type_name(v)),
            ))
        }
    }
    match mf.get("function_call") {
        None | Some(Value::Null) => {}
        Some(Value::Object(fm)) => {
            let ff = Fields(fm);
            let name = ff
                .string("name")
                .map_err(|_| {
                    ApiError::invalid_type(format!("{at}.function_call.name"), "a string")
                })?
                .ok_or_else(|| ApiError::missing(&format!("{at}.function_call.name")))?;
            check_name(name, &format!("{at}.function_call.name"))?;
            let arguments = arguments(
                ff.get("arguments"),
                &format!("{at}.function_call.arguments"),
            )?;
            out.push(HistoryCall {
                id: format!("call_{}", out.len()),
                name: name.to_string(),
                arguments,
            });
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                format!("{at}.function_call"),
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    Ok(out)
}

/// The messages as the template renders them, and the `tools` variable.
/// A native format passes calls and results to the template; the generic
/// one writes them as text (a template with no tool format knows no
/// `tool_calls`), and shows the tools in the system message.
pub(crate) fn render(
    format: Format,
    msgs: &[Message],
    tools: Option<&ToolRequest>,
) -> (Vec<ChatMessage>, Option<TemplateValue>) {
    let active = tools.filter(|t| t.set.active());
    if format.native() {
        let out = msgs
            .iter()
            .map(|m| {
                let role = if m.role == "function" {
                    "tool"
                } else {
                    &m.role
                };
                let mut c = ChatMessage {
                    role: role.to_string(),
                    content: m.content.clone(),
                    extra: Vec::new(),
                };
                if !m.tool_calls.is_empty() {
                    let calls = m
                        .tool_calls
                        .iter()
                        .map(|h| {
                            TemplateValue::Map(vec![
                                ("id".into(), TemplateValue::Str(h.id.clone())),
                                ("type".into(), TemplateValue::Str("function".into())),
                                (
                                    "function".into(),
                                    TemplateValue::Map(vec![
                                        ("name".into(), TemplateValue::Str(h.name.clone())),
                                        ("arguments".into(), template_value(&h.arguments)),
                                    ]),
                                ),
                            ])
                        })
                        .collect();
                    c.extra
                        .push(("tool_calls".into(), TemplateValue::List(calls)));
                }
                if let Some(id) = &m.tool_call_id {
                    c.extra
                        .push(("tool_call_id".into(), TemplateValue::Str(id.clone())));
                }
                if let Some(n) = &m.name {
                    c.extra.push(("name".into(), TemplateValue::Str(n.clone())));
                }
                c
            })
            .collect();
        let declared =
            active.map(|t| TemplateValue::List(t.declared.iter().map(template_value).collect()));
        return (out, declared);
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(msgs.len() + 1);
    // Whether the last message written holds tool results (a turn's
    // results go in one user message).
    let mut results_open = false;
    for m in msgs {
        match m.role.as_str() {
            "tool" | "function" => {
                let line = format.history_result(
                    m.tool_call_id.as_deref(),
                    m.name.as_deref(),
                    m.content.as_deref().unwrap_or(""),
                );
                match out.last_mut() {
                    Some(prev) if results_open => {
                        let joined = format!("{}\n{line}", prev.text());
                        prev.content = Some(joined);
                    }
                    _ => out.push(ChatMessage::new("user", line)),
                }
                results_open = true;
                continue;
            }
            "assistant" if !m.tool_calls.is_empty() => {
                let calls: Vec<(String, Value)> = m
                    .tool_calls
                    .iter()
                    .map(|h| (h.name.clone(), h.arguments.clone()))
                    .collect();
                let text = format.history_calls(&calls);
                let content = match m.content.as_deref() {
                    Some(c) if !c.is_empty() => format!("{c}\n{text}"),
                    _ => text,
                };
                out.push(ChatMessage::new("assistant", content));
            }
            _ => out.push(ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                extra: Vec::new(),
            }),
        }
        results_open = false;
    }
    if let Some(t) = active {
        let prompt = format.system_prompt(&t.set);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                let joined = match first.text() {
                    "" => prompt,
                    s => format!("{s}\n\n{prompt}"),
                };
                first.content = Some(joined);
            }
            _ => out.insert(0, ChatMessage::new("system", prompt)),
        }
    }
    (out, None)
}

/// The call grammar, compiled in the request's cache scope (after the
/// thought, for a thinking model; `opened`: the prompt opened it); `None`
/// when nothing is constrained. A schema the grammar engine refuses is a
/// 400 naming its tool.
pub(crate) fn compile(
    st: &AppState,
    scope: request::Scope,
    t: &ToolRequest,
    opened: bool,
) -> Result<Option<request::Constraint>, ApiError> {
    let param = t.param();
    let field = |i: Option<usize>| match (i, t.legacy) {
        (Some(i), true) => format!("functions[{i}].parameters"),
        (Some(i), false) => format!("tools[{i}].function.parameters"),
        (None, _) => param.to_string(),
    };
    let g = st
        .tool_format
        .grammar(&t.set, &st.tool_markers)
        .map_err(|e| ApiError::invalid_value(field(e.tool), e.message))?;
    let Some(g) = g else { return Ok(None) };
    // A thinking model calls after its thought.
    let g = st.reasoning.after_thought(&g, opened).unwrap_or(g);
    let compiler = st.grammar().map_err(ApiError::internal)?;
    let spec = request::GrammarSpec::Lark(g);
    match compiler.compile(scope, &spec) {
        Ok(c) => Ok(Some(request::Constraint {
            spec: Arc::new(spec),
            compiled: Some(c as Arc<dyn std::any::Any + Send + Sync>),
        })),
        Err(e) => {
            // Which tool: the first whose own call grammar fails.
            for (i, tool) in t.set.tools.iter().enumerate() {
                let one = ToolSet {
                    tools: vec![tool.clone()],
                    choice: Choice::Required,
                    parallel: false,
                };
                if let Ok(Some(g1)) = st.tool_format.grammar(&one, &st.tool_markers) {
                    if let Err(e1) = compiler.compile_cold(&request::GrammarSpec::Lark(g1)) {
                        return Err(ApiError::invalid_value(
                            field(Some(i)),
                            format!("schema: {e1}"),
                        ));
                    }
                }
            }
            Err(ApiError::invalid_value(param, format!("grammar: {e}")))
        }
    }
}
