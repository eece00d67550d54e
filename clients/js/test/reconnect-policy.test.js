// The reconnect/resume policy of wsserver.js, row by row of
// clients/reconnect-policy.json: the table tests/test_reconnect_policy.py
// runs the Python clients against, so the two cannot drift apart.
//
// Plain functions of plain values: no server, no socket, no timer. Run by
// tests/test_js_node.py (`node --test clients/js/test/reconnect-policy.test.js`).

import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";

import { RECONNECT_DEFAULTS, reconnectPolicy } from "../wsserver.js";

const TABLE = JSON.parse(readFileSync(new URL("../../reconnect-policy.json", import.meta.url), "utf8"));

/** The table counts seconds, the JS client milliseconds. */
const MS = 1000;

/**
 * @param {number} actual
 * @param {number} expected
 * @param {string} why
 */
function near(actual, expected, why) {
  assert.ok(Math.abs(actual - expected) < 1e-6, `${why}: ${actual} is not ${expected}`);
}

test("the numbers are the table's", () => {
  const policy = TABLE.policy;
  assert.deepEqual(
    { ...RECONNECT_DEFAULTS },
    {
      initialDelayMs: policy.first_delay_s * MS,
      maxDelayMs: policy.max_delay_s * MS,
      factor: policy.factor,
      jitter: policy.jitter,
      maxAttempts: Infinity, // the connection's own give-up: none (the JS client stays connected)
      resumeTimeoutMs: policy.timeout_s * MS,
    },
  );
  assert.deepEqual({ ...reconnectPolicy.gaveUp }, TABLE.gave_up);
});

test("the wait before each try, or giving up", () => {
  for (const row of TABLE.waits) {
    const wait = reconnectPolicy.waitMs(RECONNECT_DEFAULTS, row.attempt, row.elapsed_s * MS, row.draw);
    if (row.wait_s === null) assert.equal(wait, null, row.why);
    else near(Number(wait), row.wait_s * MS, row.why);
  }
});

test("what a lost connection keeps", () => {
  for (const row of TABLE.losses) {
    assert.equal(reconnectPolicy.keepsOnLoss(row.resume_token !== null, row.reconnecting), row.kept, row.why);
  }
});

test("what a kept request sends on the new connection", () => {
  for (const row of TABLE.resumes) {
    const { id, resume_token: resumeToken, last_seq: lastSeq, abandoned } = row.request;
    assert.deepEqual(reconnectPolicy.resumeFrame({ id, resumeToken, lastSeq, abandoned }), row.frame, row.why);
  }
});

test("which errors about a resume are retried", () => {
  for (const row of TABLE.errors) {
    assert.equal(reconnectPolicy.retriesRefusal(row.code, row.resuming), row.retried, row.why);
  }
});
