// The Node clients of the OpenAI-compatible API, pointed at the server for the tests:
// the `openai` SDK's Responses API and chat completions, and the Vercel AI SDK's OpenAI
// provider (which calls /responses). Prints one JSON object: what each client got.
//
//   NODE_CLIENTS_HOME=<dir with node_modules> BASE_URL=http://127.0.0.1:<port>/v1 \
//   QUESTION="..." node tests/node_clients/clients.mjs
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const require = createRequire(join(process.env.NODE_CLIENTS_HOME, "package.json"));
const load = async (name) => import(pathToFileURL(require.resolve(name)).href);

const { default: OpenAI } = await load("openai");
const { generateText, streamText } = await load("ai");
const { createOpenAI } = await load("@ai-sdk/openai");

const baseURL = process.env.BASE_URL;
const question = process.env.QUESTION;
const out = {};

const client = new OpenAI({ baseURL, apiKey: "anything", maxRetries: 0 });
const whole = await client.responses.create({ model: "webSearch", input: question });
out.openaiResponse = {
  status: whole.status,
  text: whole.output_text,
  types: whole.output.map((item) => item.type),
  annotations: whole.output.find((item) => item.type === "message").content[0].annotations,
  usage: whole.usage,
};
const stream = await client.responses.create({ model: "webSearch", input: question, stream: true });
const events = [];
for await (const event of stream) events.push(event);
out.openaiStream = {
  types: events.map((e) => e.type),
  numbers: events.map((e) => e.sequence_number),
  text: events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join(""),
};
const next = await client.responses.create({
  model: "deepSeek",
  input: "and then?",
  previous_response_id: whole.id,
});
out.openaiFollowUp = { previous: next.previous_response_id, status: next.status };
try {
  await client.responses.create({ model: "nope", input: question });
} catch (error) {
  out.openaiError = { status: error.status, message: error.message };
}
const completion = await client.chat.completions.create({
  model: "webSearch",
  messages: [{ role: "user", content: question }],
  search_domain_filter: ["-pinterest.com"],
});
out.openaiCompletion = { text: completion.choices[0].message.content, citations: completion.citations };

const provider = createOpenAI({ baseURL, apiKey: "anything" });
const generated = await generateText({ model: provider("webSearch"), prompt: question, maxRetries: 0 });
out.vercelGenerate = {
  text: generated.text,
  reasoning: generated.reasoningText ?? null,
  sources: (generated.sources ?? []).map((s) => s.url),
  finishReason: generated.finishReason,
  usage: generated.usage,
};
const streamed = streamText({ model: provider("webSearch"), prompt: question, maxRetries: 0 });
let text = "";
const parts = [];
for await (const part of streamed.fullStream) {
  parts.push(part.type);
  if (part.type === "error") parts.push(String(part.error));
}
for await (const chunk of streamText({ model: provider("webSearch"), prompt: question }).textStream) text += chunk;
out.vercelStream = {
  text,
  parts,
  sources: (await streamed.sources).map((s) => s.url),
  reasoning: (await streamed.reasoningText) ?? null,
  finishReason: await streamed.finishReason,
};
console.log(JSON.stringify(out));
