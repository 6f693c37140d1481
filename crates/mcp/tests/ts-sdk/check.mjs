// Drives Sandpit's MCP server over Streamable HTTP with the official
// TypeScript SDK, the client most desktop agents embed. Run by
// crates/mcp/tests/ts_sdk.rs as `node --no-warnings check.mjs URL KEY`.
//
// The SDK compiles every tool's outputSchema with Ajv when it lists the
// tools, and validates each result's structuredContent against it; Ajv
// reports what it cannot make sense of (`unknown format "uint32" ignored in
// schema ...`) with console.warn. This script compiles the inputSchemas with
// the SDK's own validator too, calls every tool, and prints one JSON line on
// stdout; anything on stderr is something a user of the SDK would see, and
// the Rust test fails on it. (`--no-warnings` silences only Node's own
// process warnings, such as Node 18's note that fetch is experimental.)

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { AjvJsonSchemaValidator } from '@modelcontextprotocol/sdk/validation/ajv';

const [url, key] = process.argv.slice(2);
if (!url || !key) {
  console.error('usage: node check.mjs MCP_URL API_KEY');
  process.exit(2);
}

// The sandbox create_sandbox makes (the fake SandboxApi's ids are random,
// as the service's are); the calls after it act on it.
const sandbox = { sandbox_id: 'sbx_not_created_yet' };
// The snapshot snapshot_sandbox makes; restore_sandbox and delete_snapshot use it.
const snapshot = { snapshot_id: 'snap_not_taken_yet' };
// Every tool, with arguments the test's fake SandboxApi (sandpit-fake) answers.
const calls = [
  ['get_service_info', () => ({})],
  ['create_sandbox', () => ({ size: 'small', name: 'job', timeout_minutes: 30 })],
  ['get_sandbox', () => sandbox],
  ['write_file', () => ({ ...sandbox, path: 'a.py', content: "print('hi')" })],
  ['read_file', () => ({ ...sandbox, path: 'a.py' })],
  ['list_files', () => ({ ...sandbox, recursive: false })],
  ['expose_port', () => ({ ...sandbox, port: 8000 })],
  ['list_sandboxes', () => ({ limit: 10 })],
  ['extend_sandbox', () => ({ ...sandbox, additional_minutes: 30 })],
  ['update_network', () => ({ ...sandbox, allow_out: ['203.0.113.7'], deny_out: ['0.0.0.0/0'] })],
  ['run_command', () => ({ ...sandbox, command: 'echo hi', timeout_ms: 5000 })],
  ['snapshot_sandbox', () => ({ ...sandbox, name: 'before' })],
  ['restore_sandbox', () => ({ ...sandbox, ...snapshot })],
  ['fork_sandbox', () => ({ ...sandbox, count: 2, timeout_minutes: 10 })],
  ['pause_sandbox', () => sandbox],
  ['resume_sandbox', () => sandbox],
  ['list_snapshots', () => ({ limit: 10 })],
  ['delete_snapshot', () => snapshot],
  ['list_templates', () => ({ all_builds: true })],
  ['create_volume', () => ({ name: 'data', size_gb: 2 })],
  ['list_volumes', () => ({})],
  ['delete_volume', () => ({ volume: 'data' })],
  ['get_usage', () => ({ days: 7 })],
  ['destroy_sandbox', () => sandbox],
];
// Arguments the input schemas must refuse: their ranges mean something to Ajv.
const refused = [
  ['expose_port', { ...sandbox, port: 70000 }],
  ['create_sandbox', { timeout_minutes: 0 }],
  ['run_command', { ...sandbox, command: 'true', timeout_ms: 1.5 }],
  ['fork_sandbox', { ...sandbox, count: 11 }],
  ['restore_sandbox', { ...sandbox }],
  ['create_volume', { size_gb: 2 }],
  ['delete_volume', {}],
];

const client = new Client({ name: 'sandpit-ts-sdk-test', version: '0' });
const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: { Authorization: `Bearer ${key}` } },
});
await client.connect(transport);

const { tools } = await client.listTools();
const byName = new Map(tools.map((t) => [t.name, t]));
const inputs = new AjvJsonSchemaValidator();
const validateInput = new Map(tools.map((t) => [t.name, inputs.getValidator(t.inputSchema)]));

const failures = [];
for (const [name, argsOf] of calls) {
  const args = argsOf();
  if (!byName.has(name)) {
    failures.push(`${name}: not in tools/list`);
    continue;
  }
  const accepted = validateInput.get(name)(args);
  if (!accepted.valid) failures.push(`${name}: its inputSchema refuses ${JSON.stringify(args)}: ${accepted.errorMessage}`);
  if (!client.getToolOutputValidator(name)) failures.push(`${name}: the SDK compiled no outputSchema`);
  // callTool validates structuredContent against the outputSchema and throws if it does not match.
  const result = await client.callTool({ name, arguments: args });
  if (result.isError) failures.push(`${name}: isError: ${JSON.stringify(result.content)}`);
  if (!result.structuredContent) failures.push(`${name}: no structuredContent`);
  if (name === 'create_sandbox' && result.structuredContent) sandbox.sandbox_id = result.structuredContent.id;
  if (name === 'snapshot_sandbox' && result.structuredContent) snapshot.snapshot_id = result.structuredContent.id;
}
for (const [name, args] of refused) {
  if (validateInput.get(name)(args).valid) failures.push(`${name}: its inputSchema accepts ${JSON.stringify(args)}`);
}
await client.close();

if (failures.length > 0) {
  console.error(failures.join('\n'));
  process.exit(1);
}
console.log(JSON.stringify({
  protocolVersion: transport.protocolVersion,
  tools: tools.map((t) => t.name),
  called: calls.map(([name]) => name),
}));
