// The official OpenAI Node SDK's tool runner against isoserve: `runTools`
// with `zodFunction` tools, streamed and not. The runner sends the tools,
// assembles the calls (from deltas when streaming), parses the arguments
// with the zod schema, calls the function, sends its result back as a
// `tool` message, and asks again. Prints one JSON line of what happened;
// tests/http/test_node_sdk.py checks it.
//
//     node tests/node/tools.mjs http://127.0.0.1:PORT/v1
import OpenAI from "openai";
import { zodFunction } from "openai/helpers/zod";
import { z } from "zod";

const baseURL = process.argv[2];
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const MODEL = "SmolLM2-135M-Instruct.Q4_1";

const Weather = z.object({
  city: z.string().max(40),
  unit: z.enum(["celsius", "fahrenheit"]),
});

function tools(calls) {
  return [
    zodFunction({
      name: "get_weather",
      description: "Current weather in a city",
      parameters: Weather,
      function: (args) => {
        // zod parsed the arguments before the runner called this.
        calls.push(Weather.parse(args));
        return { city: args.city, sky: "clear", degrees: 21 };
      },
    }),
  ];
}

const out = {};
for (const stream of [false, true]) {
  const calls = [];
  const params = {
    model: MODEL,
    messages: [{ role: "user", content: "What is the weather in Paris?" }],
    tools: tools(calls),
    tool_choice: { type: "function", function: { name: "get_weather" } },
    temperature: 0,
    max_tokens: 120,
  };
  const runner = client.chat.completions.runTools(stream ? { ...params, stream } : params);
  await runner.done();
  const messages = runner.messages;
  out[stream ? "stream" : "whole"] = {
    calls,
    roles: messages.map((m) => m.role),
    tool_call_ids: messages.filter((m) => m.role === "assistant").flatMap((m) => (m.tool_calls || []).map((c) => c.id)),
    tool_result_ids: messages.filter((m) => m.role === "tool").map((m) => m.tool_call_id),
    tool_result: messages.filter((m) => m.role === "tool").map((m) => m.content)[0],
  };
}

// `auto`, several rounds: the call's result goes back to the model, which
// answers or calls again (at most three completions). The prompt names the
// tool: under `auto` the 135M model's greedy choice between calling and
// writing prose turns on small logit margins, and a prompt that only opened
// a JSON object stopped calling (and ran to the length limit, which the
// runner throws on) when the attention kernel's order of sums changed.
{
  const calls = [];
  const runner = client.chat.completions.runTools(
    {
      model: MODEL,
      messages: [{ role: "user", content: "Call get_weather for Paris." }],
      tools: tools(calls),
      tool_choice: "auto",
      parallel_tool_calls: false,
      temperature: 0,
      max_tokens: 120,
    },
    { maxChatCompletions: 3 },
  );
  await runner.done();
  out.auto = {
    calls,
    roles: runner.messages.map((m) => m.role),
    completions: runner.allChatCompletions().length,
  };
}
console.log(JSON.stringify(out));
