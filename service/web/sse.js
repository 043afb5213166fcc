// Server-sent events from a fetch() body: EventSource cannot POST or send an Authorization header,
// so the chat reads its stream with this parser.

// Splits text arriving in arbitrary chunks into events; each event is the joined `data:` lines.
export class SseParser {
  constructor() {
    this.buffer = "";
  }

  // Returns the data of every event completed by this chunk.
  push(text) {
    this.buffer += text.replace(/\r\n?/g, "\n");
    const events = [];
    let end;
    while ((end = this.buffer.indexOf("\n\n")) >= 0) {
      const block = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const data = dataOf(block);
      if (data !== null) events.push(data);
    }
    return events;
  }
}

function dataOf(block) {
  const lines = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("data:")) lines.push(line.slice(line[5] === " " ? 6 : 5));
  }
  return lines.length ? lines.join("\n") : null;  // comments and retry-only blocks carry no data
}

// Yields the data of each event of a fetch() Response until the body ends.
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const parser = new SseParser();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    yield* parser.push(decoder.decode(value, { stream: true }));
  }
  yield* parser.push(decoder.decode() + "\n\n");
}
