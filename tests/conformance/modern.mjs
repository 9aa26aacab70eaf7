// Runs the official conformance CLI (0.2.0-alpha.12 or later) for the 2026-07-28 revision:
// `server ...` becomes `server --requirements 2026-07-28 ...`, which runs exactly the scenarios
// that revision requires. Used as CONF_JS of run_conformance_stdio.sh (see baseline-2026-07-28.yml).
import { pathToFileURL } from 'node:url';
import { homedir } from 'node:os';

const harness = process.env.HARNESS_DIR || `${homedir()}/.cache/mcp-harness`;
const cli = process.env.CONF2_JS ||
  `${harness}/conf2/node_modules/@modelcontextprotocol/conformance/dist/index.js`;
if (process.argv[2] === 'server' && !process.argv.includes('--requirements')) {
  process.argv.splice(3, 0, '--requirements', '2026-07-28');
}
await import(pathToFileURL(cli).href);
