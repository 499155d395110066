// The TypeScript SDK's Streamable HTTP client pointed at /mcp: lists the tools, asks a
// question with a progress callback, and searches. Prints one JSON object: what it got.
//
//   MCP_CLIENTS_HOME=<dir with node_modules> URL=http://127.0.0.1:<port>/mcp \
//   QUESTION="..." [KEY=<bearer key>] node tests/mcp_clients/sdk.mjs
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const require = createRequire(join(process.env.MCP_CLIENTS_HOME, "package.json"));
const load = async (name) => import(pathToFileURL(require.resolve(name)).href);

const { Client } = await load("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = await load(
  "@modelcontextprotocol/sdk/client/streamableHttp.js",
);

const headers = process.env.KEY ? { Authorization: `Bearer ${process.env.KEY}` } : {};
const transport = new StreamableHTTPClientTransport(new URL(process.env.URL), {
  requestInit: { headers },
});
const client = new Client({ name: "searchchat-test", version: "1.0.0" });
await client.connect(transport);

const out = { sessionId: transport.sessionId, version: transport.protocolVersion };
out.tools = (await client.listTools()).tools.map((tool) => tool.name);
const progress = [];
const asked = await client.callTool(
  { name: "ask", arguments: { question: process.env.QUESTION } },
  undefined,
  { onprogress: (p) => progress.push(p) },
);
out.ask = { structured: asked.structuredContent, text: asked.content[0].text, progress };
const found = await client.callTool({
  name: "web_search",
  arguments: { query: process.env.QUESTION, max_results: 2 },
});
out.search = found.structuredContent;
await transport.terminateSession();
await client.close();
console.log(JSON.stringify(out));
