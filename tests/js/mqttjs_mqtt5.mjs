// MQTT.js exercising lmqtt's MQTT 5 features (tests/e2e/test_e2e_mqtt5.py): topic aliases in both
// directions (MQTT.js resolves the aliases we send and assigns its own when we allow them),
// subscription identifiers, subscription options and message expiry as another client sees them.
//
//   node mqttjs_mqtt5.mjs sub URL FILTER COUNT TIMEOUT_MS OPTIONS_JSON
//       connect with topicAliasMaximum 10, subscribe with OPTIONS_JSON ({qos, nl, rap, rh, sid}),
//       print {"event":"subscribed",...} then one JSON line per message (topic, payload, retain,
//       subscriptionIdentifier, messageExpiryInterval, topicAlias seen on the wire), exit after COUNT
//       or TIMEOUT
//   node mqttjs_mqtt5.mjs pub URL MESSAGES_JSON
//       publish [{topic, payload, qos, retain, messageExpiryInterval}] in order with
//       autoAssignTopicAlias (repeated topics go out as alias + empty topic), each awaited, then
//       print {"event":"published","count":n,"topicAliasMaximum":<from CONNACK>}
import mqtt from "mqtt";

const [mode, url, ...rest] = process.argv.slice(2);
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");

async function sub(filter, count, timeoutMs, o) {
  const c = await mqtt.connectAsync(url, {
    protocolVersion: 5, clientId: `mqttjs5-sub-${process.pid}`, clean: true, reconnectPeriod: 0,
    connectTimeout: 5000, properties: { topicAliasMaximum: 10 },
  });
  let n = 0;
  const done = () => c.endAsync().then(() => process.exit(0));
  const timer = setTimeout(() => { out({ event: "timeout", received: n }); done(); }, timeoutMs);
  // the alias as it came on the wire (MQTT.js resolves it and removes it from the packet)
  c.on("packetreceive", (packet) => {
    if (packet.cmd === "publish") {
      const p = packet.properties || {};
      out({ event: "wire", topic: packet.topic, topicAlias: p.topicAlias === undefined ? null : p.topicAlias });
    }
  });
  c.on("message", (topic, payload, packet) => {
    const p = packet.properties || {};
    let sid = p.subscriptionIdentifier === undefined ? null : p.subscriptionIdentifier;
    if (sid !== null && !Array.isArray(sid)) sid = [sid];
    out({ event: "message", topic, payload: payload.toString("utf8"), qos: packet.qos, retain: packet.retain,
          subscriptionIdentifier: sid,
          messageExpiryInterval: p.messageExpiryInterval === undefined ? null : p.messageExpiryInterval });
    n += 1;
    if (n >= count) { clearTimeout(timer); done(); }
  });
  const opts = { qos: o.qos || 0, nl: !!o.nl, rap: !!o.rap, rh: o.rh || 0 };
  if (o.sid) opts.properties = { subscriptionIdentifier: o.sid };
  const granted = await c.subscribeAsync(filter, opts);
  out({ event: "subscribed", granted: granted.map((g) => g.qos) });
}

async function pub(messages) {
  const c = await mqtt.connectAsync(url, {
    protocolVersion: 5, clientId: `mqttjs5-pub-${process.pid}`, clean: true, reconnectPeriod: 0,
    connectTimeout: 5000, autoAssignTopicAlias: true,
  });
  let aliasMax = null;
  for (const m of messages) {
    const opts = { qos: m.qos || 0, retain: !!m.retain };
    if (m.messageExpiryInterval) opts.properties = { messageExpiryInterval: m.messageExpiryInterval };
    await c.publishAsync(m.topic, m.payload, opts);
  }
  if (c.topicAliasSend) aliasMax = c.topicAliasSend.max;
  out({ event: "published", count: messages.length, topicAliasMaximum: aliasMax });
  await c.endAsync();
}

try {
  if (mode === "sub") {
    const [filter, count, timeoutMs, options] = rest;
    await sub(filter, Number(count), Number(timeoutMs), JSON.parse(options || "{}"));
  } else if (mode === "pub") {
    await pub(JSON.parse(rest[0]));
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
} catch (e) {
  out({ event: "error", message: String(e && e.message || e) });
  process.exit(1);
}
