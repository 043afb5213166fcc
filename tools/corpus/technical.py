"""Code, data formats, lists and numbers, so the vocabulary covers more than prose."""

TEXT = r"""
# Getting Started

Install the package and run the tests:

```bash
pip install -e .
python -m pytest -q tests/
```

## Example

```python
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5


def fibonacci(n: int) -> list[int]:
    # The first n Fibonacci numbers.
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


def word_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
    print(Point(0, 0).distance(Point(3, 4)))  # 5.0
```

```javascript
function debounce(fn, delay) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), delay);
  };
}

const total = [3, 7, 12].reduce((sum, n) => sum + n, 0);
console.log(`Total: ${total}`);
```

```sql
SELECT customer_id, COUNT(*) AS orders, SUM(amount) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
ORDER BY spent DESC
LIMIT 10;
```

```json
{
  "name": "example-service",
  "version": "1.4.2",
  "port": 8080,
  "debug": false,
  "tags": ["api", "internal", "v1"],
  "limits": {"requests_per_minute": 600, "max_body_bytes": 1048576}
}
```

```yaml
server:
  host: 0.0.0.0
  port: 8000
  workers: 4
logging:
  level: info
  format: "%(asctime)s %(levelname)s %(message)s"
```

| Model | Parameters | Context | Score |
|-------|-----------:|--------:|------:|
| small | 125M | 2048 | 41.2 |
| base | 1.3B | 4096 | 55.8 |
| large | 7B | 8192 | 68.4 |

Release notes for version 2.3.0 (released 2024-03-15):
- Added support for streaming responses over HTTP/1.1 and HTTP/2.
- Fixed a crash when the configuration file was empty (issue #1287).
- Improved startup time by 35% on machines with more than 16 cores.
- Deprecated the `--legacy-mode` flag; it will be removed in 3.0.

Error: connection refused (errno 111) while connecting to 127.0.0.1:5432.
Warning: disk usage at 91% on /dev/sda1; consider freeing space.
Traceback (most recent call last):
  File "main.py", line 42, in <module>
    result = compute(values)
ZeroDivisionError: division by zero

Useful keyboard shortcuts: Ctrl+C copies, Ctrl+V pastes, Ctrl+Z undoes, and Ctrl+Shift+T reopens the
last closed tab. On a Mac, use Cmd instead of Ctrl.

Contact: support@example.com, +1 (555) 010-0199, https://www.example.org/help?topic=billing&lang=en

Numbers and units: 3.14159, 2.71828, 1/3, 0.5%, 100 km/h, 9.81 m/s^2, 1,000,000, 1e-6, -40 °C,
$19.99, €25, £7.50, ¥1200, 6 × 7 = 42, 2 + 2 ≠ 5, x ≤ y, 50–60 minutes.

Names and places: Zürich, São Paulo, Kraków, Reykjavík, Nguyễn, Müller, Dvořák, Ærø, Ōsaka, Łódź.
A few words from other languages: café, naïve, façade, déjà vu, smörgåsbord, jalapeño, Straße.
Quotation marks and dashes: “double”, ‘single’, «guillemets», and the em dash — like this.
Emoji sometimes appear in chat messages 🙂 👍 🎉 ❤️ and should survive a round trip unchanged.
Other scripts: Привет, мир! Γειά σου κόσμε. 你好，世界。 こんにちは世界。
안녕하세요. مرحبا بالعالم. שלום עולם.

Checklist before a release:
[x] All tests pass on the main branch.
[x] The changelog is up to date.
[ ] The documentation has been rebuilt.
[ ] The version number has been bumped in pyproject.toml.

Dates and times: Monday, 4 March 2024; 2024-03-04T09:30:00Z; 12:45 pm; Q3 2023; the 1990s; 7 days
ago; every 15 minutes; from 9 to 5; the 21st century; 3rd of May; 1st, 2nd, 3rd, 4th, 5th.

Roman numerals: I, II, III, IV, V, VI, VII, VIII, IX, X, L, C, D, M; MMXXIV is 2024.
The alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \ | @ # $ % ^ & * - _ = + ~ `
"""
