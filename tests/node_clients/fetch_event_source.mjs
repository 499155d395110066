// `@microsoft/fetch-event-source`, as web clients use it against the SSE transport: an
// answer read whole, then a resume from one of its event ids, with `JSON.parse` of every
// message's data in the handler (a block without data would throw there). Prints one
// JSON object: what each read got.
//
//   NODE_CLIENTS_HOME=<dir with node_modules> BASE_URL=http://127.0.0.1:<port> \
//   QUESTION="..." node tests/node_clients/fetch_event_source.mjs
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const require = createRequire(join(process.env.NODE_CLIENTS_HOME, "package.json"));
const load = async (name) => import(pathToFileURL(require.resolve(name)).href);

// the library was written for browsers: it reads `window` and `document`
globalThis.window = globalThis;
globalThis.document = { hidden: false, addEventListener() {}, removeEventListener() {} };

const { fetchEventSource } = await load("@microsoft/fetch-event-source");
const base = process.env.BASE_URL;

class Fatal extends Error {}

async function read(url, init) {
  const got = { events: [], ids: [], retries: 0, errors: [] };
  await fetchEventSource(url, {
    ...init,
    openWhenHidden: true,
    async onopen(response) {
      got.status = response.status;
      if (!response.ok) throw new Fatal(`status ${response.status}`);
    },
    onmessage(message) {
      got.events.push(JSON.parse(message.data)); // throws on a message without data
      got.ids.push(message.id);
    },
    onerror(error) {
      got.errors.push(String(error));
      throw error; // no retry: a test must see the first failure
    },
  });
  return got;
}

const out = {};
out.answer = await read(`${base}/api/chat/sse`, {
  method: "POST",
  headers: { "content-type": "application/json" },
  body: JSON.stringify({
    type: "message",
    message: { content: process.env.QUESTION },
    focusMode: "webSearch",
  }),
});
const chatId = out.answer.events[0].chatId;
const from = out.answer.ids[1];
out.resume = await read(`${base}/api/chat/sse/resume?chatId=${encodeURIComponent(chatId)}`, {
  method: "GET",
  headers: { "last-event-id": from },
});
out.resumedFrom = from;
console.log(JSON.stringify(out));
