"""The texts the tokenizer proof encodes with both tokenizers: deterministic, at least
10,000, chosen where a converted tokenizer could drift from Qwen's.

- scripts: Latin with diacritics, CJK, Cyrillic, Greek, Arabic, Hebrew, Devanagari,
  Bengali, Tamil, Thai, Georgian, Armenian, Ethiopic, Hangul, kana, and letters of recent
  Unicode versions (where the two regex engines' Unicode tables could disagree on \\p{L});
- the split pattern's edges: contractions in any case, one leading non-letter before a
  letter run, punctuation runs ending in line breaks, digit runs (Qwen splits every digit;
  cl100k keeps three), digits of other scripts, fractions and superscripts;
- whitespace: runs of spaces, tabs, CRLF, lone CR, trailing spaces, no-break and
  ideographic spaces, line and paragraph separators, form feed, zero-width characters;
- code in several languages, JSON, markup;
- emoji with skin tones, ZWJ sequences, flags, keycaps, variation selectors;
- text that NFC changes (decomposed accents, Hangul jamo, the Angstrom sign);
- special-token text, whole and broken, alone and inside other text;
- then mixtures of all of the above, drawn with a fixed seed.

`texts()` returns the same list on every Python 3 release (random.Random with an integer
seed draws the same numbers); `fingerprint()` is its sha256, which the proof reports.
"""

from __future__ import annotations

import hashlib
import random

from qwen_kvprep.convert.bpe import SPECIAL_TOKENS

SIZE = 12_000
SEED = 37

SCRIPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Größenwahn ist schön: Straße, Ärger, Öl, Übermut.",
    "L'été dernier, où étiez-vous ? À bientôt, garçon !",
    "Tiếng Việt có dấu: Người ta đã nói rằng ước mơ là miễn phí.",
    "Zażółć gęślą jaźń. Čeština: příliš žluťoučký kůň úpěl ďábelské ódy.",
    "İstanbul'da ılık bir gün; ağaçlar yeşil, ÇĞİÖŞÜ çğıöşü.",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ўзбекча, Українська: ґанок, їжак, є, і.",
    "العربية: نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر.",
    "עברית: דג סקרן שט בים מאוכזב ולפתע מצא חברה.",
    "हिन्दी: ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश।",
    "বাংলা: আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "தமிழ்: யாமறிந்த மொழிகளிலே தமிழ்மொழி போல் இனிதாவது எங்கும் காணோம்.",
    "ภาษาไทย: เป็นมนุษย์สุดประเสริฐเลิศคุณค่า",
    "ქართული: ოთხი თეთრი თხა. Հայերեն: Բարեւ աշխարհ։",
    "አማርኛ: ሰላም ለዓለም። ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ",
    "中文：我能吞下玻璃而不伤身体。人工智能正在改变世界。",
    "繁體中文：我能吞下玻璃而不傷身體。龜鼈鬱鬱蔥蔥。",
    "日本語：いろはにほへと ちりぬるを カタカナ ﾊﾝｶｸ 漢字。",
    "한국어: 다람쥐 헌 쳇바퀴에 타고파. 가나다라마바사",
    "𠀀𠀁𪚥𰻞 (CJK extensions B, G) 〇〡〢",
    "Recent letters: 𐖰𐖱𐖲 (Vithkuqi) 𞊐𞊑 (Toto) 𑼄𑼅 (Kawi) 𞁐 ꟀꟁꟐ",
    "Rare ideographs: \U00031350\U00031351\U00031352\n \n(CJK Extension H) "
    "\U0002ebf0\U0002ebf1\n\n (I)",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≤ r²; ∑ᵢ aᵢ ≠ ∞; ½ ¾ ⅓ ⅞; Ⅻ ⅻ ↉",
    "Digits elsewhere: ١٢٣٤٥ ۱۲۳ ०१२३ ১২৩ ๑๒๓ １２３ 𝟏𝟐𝟑 ①②③ ⁴⁵⁶ ₇₈₉",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　ａｎｄ　ｐｕｎｃｔｕａｔｉｏｎ！？",
    "Ligatures ﬁ ﬂ ﬀ ﬃ, letterlike ℃ ℉ № ™ ℗ Ω K Å",
)

SPLITS = (
    "it's they're we've I'm you'll he'd IT'S THEY'RE We'Ve I'M YOU'LL HE'D",
    "don't can't won't o'clock rock'n'roll ’s ‘quoted’ “double”",
    "(hello) [world] {braces} <angle> 'single' \"double\" `tick`",
    "$100 #hashtag @mention %percent &amp; *star* _under_ ~tilde~ ^caret",
    "...!!!???---___***+++===;;;:::,,, ..\n!!\r\n??\n\n",
    "a.b.c a,b,c a;b;c a-b-c a/b/c a\\b\\c a|b|c",
    "x1 y22 z333 a4444 b55555 12ab 3.14159 2,147,483,647 1e-10 0x1F 0b1010 -42 +7",
    "0 00 000 0000 00000 123456789012345678901234567890",
    "Call 555-0100 on 2024-02-29 at 23:59:59.999 UTC+08:00, ISBN 978-3-16-148410-0",
    "v1.2.3-rc.4+build.5 192.168.0.1:8080 ::1 fe80::1%eth0",
)

WHITESPACE = (
    "  two leading spaces",
    "trailing spaces   ",
    "\ttab\tseparated\tvalues\t",
    "line one\r\nline two\r\nline three\r\n",
    "old mac\rline\rbreaks\r",
    "\n\n\nthree newlines first",
    "spaces then newline   \n   and spaces after",
    "mixed \t \n \r\n \t\t  \n\n   end",
    "no\u00a0break\u00a0space and\u3000ideographic\u3000space",
    "line\u2028separator paragraph\u2029separator",
    "form\x0cfeed vertical\x0btab",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "                                                                 ",
    "\n",
    " ",
    "\t",
    "\r\n",
    "",
)

CODE = (
    'def main(argv: list[str]) -> int:\n    """Entry point."""\n    for i in range(10):\n'
    '        print(f"{i:>4d}", end="")\n    return 0\n',
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..100).filter(|x| x % 3 == 0).collect();\n}\n",
    'const f = async (x) => { await fetch(`/api/${x}`); };  // comment\n',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY 2 DESC;",
    '{"key": "value", "list": [1, 2.5, -3e4, true, null], "nested": {"a": {}}}',
    "<html><body><div class=\"x\">Hello &amp; welcome</div><br/></body></html>",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\" | tr a-z A-Z; done\n",
    "    indented four\n        indented eight\n\t\ttwo tabs\n",
    "if (a && b || !c) { x += 1; y -= 2; z *= 3; w /= 4; } else if (q != r) {}",
    "matrix = [[1, 2, 3],\n          [4, 5, 6]]  # trailing comment   \n",
    "diff --git a/x.py b/x.py\n@@ -1,3 +1,4 @@\n-old line\n+new line\n \n",
)

EMOJI = (
    "😀😃😄😁 🙂🙃",
    "👍🏻👍🏼👍🏽👍🏾👍🏿",
    "👨‍👩‍👧‍👦 👩‍❤️‍👨 🏳️‍🌈 🧑‍💻",
    "🇫🇷🇩🇪🇯🇵🇨🇳🇺🇸 🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "1️⃣ 2️⃣ #️⃣ *️⃣ ©️ ®️ ™️",
    "❤ ❤️ ☺ ☺️ ✌️ ✔︎",
    "🦀 🐍 🦄 🫠 🫶 🪿",
)

NFC_CHANGES = (
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301",
    "A\u030angstro\u0308m and \u212b (Angstrom sign)",
    "\u1100\u1161\u11a8 (Hangul jamo) \u110b\u1173\u11ab",
    "o\u0302\u0323 o\u0323\u0302 (two marks, both orders)",
    "\u0041\u0301\u0327 \u2126 \u1e9b\u0323",
    "\u0915\u093c \u0928\u093c (Devanagari nukta)",
)

_BROKEN_SPECIALS = (
    "<|im_end",
    "im_end|>",
    "<|im_start|",
    "< |im_start|>",
    "<|IM_END|>",
    "<|extra_205|>",
    "<|extra_-1|>",
    "<|endoftext |>",
    "<||>",
    "|><|",
)


def _specials() -> list[str]:
    out = list(SPECIAL_TOKENS)
    out += [f"before{tok}after" for tok in SPECIAL_TOKENS[:8]]
    out += [
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more text<|endoftext|>",
        "<|im_end|><|im_end|><|im_start|><|extra_0|><|extra_204|>",
        " <|im_end|> spaced ",
        "\n<|im_start|>\n",
        "<|endoftext|>" * 5,
        "<|im_end|>\u0338 NFC joins the special token's last character with the mark",
    ]
    out += list(_BROKEN_SPECIALS)
    return out


def fixed() -> list[str]:
    """The hand-written texts (each once, before the mixtures)."""
    return (
        list(SCRIPTS)
        + list(SPLITS)
        + list(WHITESPACE)
        + list(CODE)
        + list(EMOJI)
        + list(NFC_CHANGES)
        + _specials()
    )


def _pieces(text: str) -> list[str]:
    return [p for p in text.replace("\n", " \n ").split(" ") if p]


_SEPARATORS = (" ", "  ", "\n", "\r\n", "\t", "", ", ", ". ", "\n\n", " \n", "   \n\t", "\u3000")


def _mixture(rng: random.Random, pool: list[str], words: list[str]) -> str:
    kind = rng.randrange(6)
    if kind == 0:  # a run of words from anywhere, joined by assorted whitespace
        n = rng.randrange(1, 24)
        text = "".join(rng.choice(words) + rng.choice(_SEPARATORS) for _ in range(n))
        return text if rng.randrange(2) else text.rstrip(" ")
    if kind == 1:  # whole texts glued together
        return "".join(rng.choice(pool) for _ in range(rng.randrange(2, 4)))
    if kind == 2:  # a slice of one text, cut anywhere (mid-word, mid-line)
        text = rng.choice(pool)
        if not text:
            return text
        a = rng.randrange(len(text))
        return text[a : a + rng.randrange(1, 80)]
    if kind == 3:  # digits and numbers of every length
        n = rng.randrange(1, 40)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        around = rng.choice(("", " ", "x", "v", "$", "-", "#", "年", "\n"))
        return around + digits + rng.choice(("", ".", "%", " apples", "px", "\n", "th"))
    if kind == 4:  # single code points from across the planes that hold text
        n = rng.randrange(1, 12)
        out = []
        for _ in range(n):
            lo, hi = rng.choice(_RANGES)
            out.append(chr(rng.randrange(lo, hi)))
        return "".join(out)
    # special-token text inside ordinary text
    words_before = rng.choice(words)
    return words_before + rng.choice(SPECIAL_TOKENS) + rng.choice(_SEPARATORS) + rng.choice(words)


# Blocks of assigned characters (letters, marks, digits, symbols, spaces), to draw from;
# surrogates are left out (they are no text and cannot be encoded as UTF-8).
_RANGES = (
    (0x20, 0x7F),
    (0xA0, 0x250),
    (0x300, 0x370),
    (0x370, 0x400),
    (0x400, 0x530),
    (0x590, 0x700),
    (0x900, 0xE00),
    (0xE00, 0xE80),
    (0x10A0, 0x1100),
    (0x1100, 0x1200),
    (0x2000, 0x2070),
    (0x2070, 0x2200),
    (0x2200, 0x2500),
    (0x3000, 0x3100),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A4),
    (0xFF00, 0xFFF0),
    (0x1F300, 0x1FA00),
    (0x20000, 0x2A6E0),
)


def texts() -> list[str]:
    """The corpus: the fixed texts, then mixtures, SIZE in all."""
    pool = fixed()
    words = [w for text in pool for w in _pieces(text)]
    rng = random.Random(SEED)
    out = list(pool)
    while len(out) < SIZE:
        out.append(_mixture(rng, pool, words))
    return out


def fingerprint(corpus: list[str]) -> str:
    digest = hashlib.sha256()
    for text in corpus:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()
