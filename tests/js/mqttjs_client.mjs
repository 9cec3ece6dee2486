// MQTT.js as a second, independent client for lmqtt's end-to-end tests (tests/e2e/test_e2e_mqttjs.py).
//
//   node mqttjs_client.mjs sub URL FILTER QOS COUNT TIMEOUT_MS [VERSION]
//       subscribe, print {"event":"subscribed","granted":[...]} then one JSON line per message
//       (topic, payload, qos, retain, user properties, content type), exit after COUNT or TIMEOUT
//   node mqttjs_client.mjs pub URL MESSAGES_JSON [VERSION]
//       publish [{topic, payload, qos, retain, userProperties, contentType}] in order, each
//       awaited (PUBACK / PUBCOMP), then print {"event":"published","count":n}
// URL: mqtt://host:port or ws://host:port/mqtt. VERSION: 5 (default) or 4.
import mqtt from "mqtt";

const [mode, url, ...rest] = process.argv.slice(2);
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");

function connect(version) {
  return mqtt.connectAsync(url, {
    protocolVersion: version,
    clientId: `mqttjs-${mode}-${process.pid}`,
    clean: true,
    reconnectPeriod: 0,
    connectTimeout: 5000,
  });
}

async function sub(filter, qos, count, timeoutMs, version) {
  const c = await connect(version);
  let n = 0;
  const done = () => c.endAsync().then(() => process.exit(0));
  const timer = setTimeout(() => { out({ event: "timeout", received: n }); done(); }, timeoutMs);
  c.on("message", (topic, payload, packet) => {
    const p = packet.properties || {};
    out({ event: "message", topic, payload: payload.toString("utf8"), qos: packet.qos, retain: packet.retain,
          userProperties: p.userProperties || null, contentType: p.contentType || null });
    n += 1;
    if (n >= count) { clearTimeout(timer); done(); }
  });
  const granted = await c.subscribeAsync(filter, { qos });
  out({ event: "subscribed", granted: granted.map((g) => g.qos) });
}

async function pub(messages, version) {
  const c = await connect(version);
  for (const m of messages) {
    const opts = { qos: m.qos || 0, retain: !!m.retain };
    if (version === 5 && (m.userProperties || m.contentType)) {
      opts.properties = {};
      if (m.userProperties) opts.properties.userProperties = m.userProperties;
      if (m.contentType) opts.properties.contentType = m.contentType;
    }
    await c.publishAsync(m.topic, m.payload, opts);
  }
  out({ event: "published", count: messages.length });
  await c.endAsync();
}

try {
  if (mode === "sub") {
    const [filter, qos, count, timeoutMs, version] = rest;
    await sub(filter, Number(qos), Number(count), Number(timeoutMs), Number(version || 5));
  } else if (mode === "pub") {
    const [messages, version] = rest;
    await pub(JSON.parse(messages), Number(version || 5));
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
} catch (e) {
  out({ event: "error", message: String(e && e.message || e) });
  process.exit(1);
}
