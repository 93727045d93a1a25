// The official OpenAI Node SDK with zod against isoserve: structured
// outputs through `zodResponseFormat` (chat.completions.parse, streamed and
// not) and `zodTextFormat` (responses.parse). Prints one JSON line of what
// it got; tests/http/test_node_sdk.py checks it.
//
//     node tests/node/structured.mjs http://127.0.0.1:PORT/v1
import OpenAI from "openai";
import { zodResponseFormat, zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";

const baseURL = process.argv[2];
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const MODEL = "SmolLM2-135M-Instruct.Q4_1";

const City = z.object({
  name: z.string().max(40),
  country: z.string().max(40),
  population_millions: z.number(),
  rivers: z.array(z.string().max(20)).max(3),
  capital: z.boolean(),
});

const out = {};
const chat = await client.chat.completions.parse({
  model: MODEL,
  messages: [{ role: "user", content: "Describe Paris as JSON." }],
  response_format: zodResponseFormat(City, "city"),
  temperature: 0,
  max_tokens: 200,
});
out.chat = {
  finish: chat.choices[0].finish_reason,
  parsed: chat.choices[0].message.parsed,
  content: chat.choices[0].message.content,
};

const stream = client.chat.completions.stream({
  model: MODEL,
  messages: [{ role: "user", content: "Describe Paris as JSON." }],
  response_format: zodResponseFormat(City, "city"),
  temperature: 0,
  max_tokens: 200,
});
let deltas = "";
stream.on("content.delta", ({ delta }) => { deltas += delta; });
const final = await stream.finalChatCompletion();
out.stream = { parsed: final.choices[0].message.parsed, deltas };

const resp = await client.responses.parse({
  model: MODEL,
  input: "Describe Paris as JSON.",
  text: { format: zodTextFormat(City, "city") },
  temperature: 0,
  max_output_tokens: 200,
});
out.responses = { status: resp.status, parsed: resp.output_parsed, text: resp.output_text };

// A schema the server cannot follow is the SDK's BadRequestError.
try {
  await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: "x" }],
    response_format: {
      type: "json_schema",
      json_schema: { name: "bad", schema: { type: "string", format: "credit-card" } },
    },
  });
  out.bad = { status: 200 };
} catch (e) {
  out.bad = { status: e.status, param: e.param, name: e.constructor.name };
}
console.log(JSON.stringify(out));
