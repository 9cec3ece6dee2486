// MQTT.js logging in to lmqtt with MQTT 5 enhanced authentication, SCRAM-SHA-256 (RFC 5802 /
// RFC 7677), the SCRAM client written here from the RFC with node's crypto: an implementation
// independent of lmqtt's on both sides (tests/e2e/test_e2e_enhanced_auth.py).
//
//   node mqttjs_scram.mjs URL CLIENT_ID USER PASSWORD TOPIC
//       CONNECT with authenticationMethod SCRAM-SHA-256 + client-first, answer the server's AUTH
//       with client-final, check the server signature in CONNACK, then subscribe to TOPIC,
//       publish one QoS 1 message to it and print {"event":"ok","payload":...,"serverVerified":true}.
//       On a refusal print {"event":"refused","reasonCode":N}.
import crypto from "node:crypto";
import mqtt from "mqtt";

const [url, clientId, user, password, topic] = process.argv.slice(2);
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const METHOD = "SCRAM-SHA-256";

const nonce = crypto.randomBytes(18).toString("base64");
const clientFirstBare = `n=${user.replace(/=/g, "=3D").replace(/,/g, "=2C")},r=${nonce}`;
const hmac = (key, data) => crypto.createHmac("sha256", key).update(data).digest();
const sha256 = (data) => crypto.createHash("sha256").update(data).digest();
const xor = (a, b) => Buffer.from(a.map((x, i) => x ^ b[i]));
const attrs = (msg) => Object.fromEntries(msg.split(",").map((kv) => [kv[0], kv.slice(2)]));
let expectedServerSignature = null;

const client = mqtt.connect(url, {
  protocolVersion: 5, clientId, username: user, clean: true, reconnectPeriod: 0, connectTimeout: 5000,
  properties: { authenticationMethod: METHOD, authenticationData: Buffer.from("n,," + clientFirstBare) },
});

client.handleAuth = (packet, callback) => {
  const serverFirst = packet.properties.authenticationData.toString();
  const a = attrs(serverFirst);
  if (!a.r.startsWith(nonce)) return callback(new Error("server nonce does not extend ours"));
  const salted = crypto.pbkdf2Sync(password, Buffer.from(a.s, "base64"), Number(a.i), 32, "sha256");
  const clientKey = hmac(salted, "Client Key");
  const withoutProof = `c=${Buffer.from("n,,").toString("base64")},r=${a.r}`;
  const authMessage = `${clientFirstBare},${serverFirst},${withoutProof}`;
  const proof = xor(clientKey, hmac(sha256(clientKey), authMessage));
  expectedServerSignature = hmac(hmac(salted, "Server Key"), authMessage).toString("base64");
  callback(null, {
    cmd: "auth", reasonCode: 0x18,
    properties: { authenticationMethod: METHOD,
                  authenticationData: Buffer.from(`${withoutProof},p=${proof.toString("base64")}`) },
  });
};

const timer = setTimeout(() => { out({ event: "timeout" }); process.exit(2); }, 10000);
client.on("error", (e) => {
  out({ event: "refused", reasonCode: e.code === undefined ? null : e.code, message: String(e.message) });
  clearTimeout(timer);
  client.end(true, () => process.exit(0));
});
client.on("connect", async (connack) => {
  const data = connack.properties?.authenticationData?.toString() || "";
  const serverVerified = expectedServerSignature !== null && data === `v=${expectedServerSignature}`;
  if (!serverVerified) {
    out({ event: "bad-server-signature", data });
    process.exit(3);
  }
  client.on("message", (t, payload) => {
    out({ event: "ok", topic: t, payload: payload.toString(), serverVerified });
    clearTimeout(timer);
    client.end(false, () => process.exit(0));
  });
  await client.subscribeAsync(topic, { qos: 1 });
  await client.publishAsync(topic, "hello from mqtt.js", { qos: 1 });
});
