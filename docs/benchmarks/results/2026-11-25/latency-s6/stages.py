import collections,sys
fn=sys.argv[1]; total_us=float(sys.argv[2])
order=[
 ("wait (GIL / idle, not CPU)", lambda fr: fr[-1].startswith(("epoll_pwait","pthread_cond_timedwait","pthread_cond_wait")) or "0x7f" in fr[-1] and any("PyThread_acquire_lock" in f or "take_gil" in f for f in fr[-4:])),
 ("socket write syscalls (2/msg)", lambda fr: fr[-1].startswith("write (libc")),
 ("socket read syscalls (2/msg)", lambda fr: fr[-1].startswith("read (libc")),
 ("CommitLog append (record, crc, map copy)", lambda fr: any(f.startswith("CommitLog.append") or f.startswith("CommitLog._append") for f in fr)),
 ("store dispatch inline: consume queue", lambda fr: any(f.startswith("ConsumeQueueStore.") for f in fr)),
 ("store dispatch inline: light-queue index", lambda fr: any(f.startswith(("LightQueueIndex.","take_batch")) for f in fr)),
 ("store dispatch inline: listeners, notify publish", lambda fr: any(f.startswith("MessageStore._after_append") for f in fr)),
 ("delivery run (engine: ring, feed, encode, queue the write)", lambda fr: any(f.startswith("InProcessBus.drain") for f in fr)),
 ("PUBACK to publisher (_acked)", lambda fr: any(f.startswith("PublishPipeline._acked") for f in fr)),
 ("publish batch rest (_flush: Message objects, ring record_appended, metrics)", lambda fr: any(f.startswith("PublishPipeline.flush") for f in fr)),
 ("decode + handlers (PUBLISH in, PUBACK in)", lambda fr: any(f.startswith("MQTTConnection.data_received") for f in fr)),
 ("write batcher / connection flush outside a batch", lambda fr: any(f.startswith(("WriteBatcher","MQTTConnection.flush")) for f in fr)),
 ("gc", lambda fr: any(f.startswith("gc_collect") for f in fr)),
 ("uvloop / interpreter rest (epoll dispatch, handles)", lambda fr: True),
]
c=collections.Counter(); N=0
for line in open(fn):
    stack,_,n=line.rstrip().rpartition(' ')
    try: n=int(n)
    except: continue
    fr=stack.split(';')
    if 'MainThread' not in fr[0]: continue
    fr=fr[1:]
    for name,pred in order:
        if pred(fr):
            c[name]+=n; break
busy=sum(v for k,v in c.items() if not k.startswith("wait"))
print("samples", sum(c.values()), "busy", busy)
for name,_ in order:
    v=c[name]
    if name.startswith("wait"): print(f"| {name} | {v} samples | – |"); continue
    print(f"| {name} | {v/busy*100:.1f} % | {v/busy*total_us:.1f} µs |")
