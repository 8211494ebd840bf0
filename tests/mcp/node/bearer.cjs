// Preloaded into the MCP conformance suite (node --require): its requests carry no credentials, and
// `execbox mcp --http` answers every request without a token with a 401. This adds
// `Authorization: Bearer $EXECBOX_MCP_TOKEN` to every request the process makes through undici (the
// global dispatcher, shared with node's own fetch), leaving every other header as the suite sent it.
"use strict";
// The suite's own undici (EXECBOX_NODE_MODULES: where scripts/node_tools.sh installed it).
const { Agent, setGlobalDispatcher } = require(require.resolve("undici", { paths: [process.env.EXECBOX_NODE_MODULES] }));
const auth = `Bearer ${process.env.EXECBOX_MCP_TOKEN}`;

function withAuth(headers) {
  if (Array.isArray(headers)) {
    return [...headers, "authorization", auth];
  }
  if (headers && typeof headers[Symbol.iterator] === "function" && typeof headers !== "string") {
    return [...Array.from(headers).flat(), "authorization", auth];
  }
  return { ...(headers || {}), authorization: auth };
}

setGlobalDispatcher(new Agent().compose((dispatch) => (opts, handler) =>
  dispatch({ ...opts, headers: withAuth(opts.headers) }, handler)));
