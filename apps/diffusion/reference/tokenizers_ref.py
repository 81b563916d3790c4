"""Reference ids for the tokenizer tests (apps/diffusion/tests/test_tokenizers.cpp).

Writes into apps/diffusion/tests/data/tokenizers/:
  captions.jsonl      the caption corpus: one JSON string a line, generated deterministically here
                      (Unicode, accents, CJK, emoji, punctuation, numbers, very long and empty text,
                      runs of spaces, tabs and newlines, special-token look-alikes).
  clip_ids.txt        per caption, transformers' CLIPTokenizer ids (BOS ... EOS, no truncation),
                      built from the vocab.json / merges.txt derived from open_clip's
                      bpe_simple_vocab_16e6.txt.gz as open_clip builds its vocabulary.
  clip_padded.txt     for every 10th caption, 77-long ids and masks: CLIP-L (pads with EOS);
                      OpenCLIP bigG as open_clip pads (with 0, "!": its SimpleTokenizer.__call__ rule
                      applied to the ids above); and transformers' CLIPTokenizer with pad_token="!"
                      (SDXL's tokenizer_2), which also reads every "!" of the text as that pad token.
  t5_test.model       a unigram SentencePiece model trained here on a second caption corpus
                      (T5's settings: nmt_nfkc, pad 0, eos 1, unk 2, no bos).
  t5_ids.txt          per caption, transformers' T5TokenizerFast ids (... EOS 1, no truncation).
  t5_padded.txt       for every 10th caption: ids and mask at max_length 32 (truncation, pad 0).
The id files hold one line per caption, ids separated by spaces ("-" for an empty list); padded files
hold "ids|mask" pairs per line.

Needs transformers, tokenizers and sentencepiece (no torch). Usage:
  python tokenizers_ref.py --bpe path/to/bpe_simple_vocab_16e6.txt.gz [--out DIR] [--unicode-sweep]
"""
import argparse
import gzip
import io
import json
import os
import random
import shutil
import tempfile
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "data", "tokenizers")

WORDS = ("a photo of cat dog bird tree house car street city night sky sun moon river mountain "
         "forest beach girl boy woman man portrait painting oil watercolor sketch red blue green "
         "yellow golden dark bright misty rainy snowy old new tiny huge wooden glass metal stone "
         "castle bridge flower garden robot astronaut dragon wizard knight ship ocean wave cloud "
         "highly detailed 4k 8k hdr trending on artstation by greg rutkowski cinematic lighting "
         "close-up wide-angle bokeh sharp focus masterpiece best quality").split()
ACCENTED = ["café", "naïve", "Ångström", "Éclair", "façade", "Ñandú", "jalapeño", "crème brûlée",
            "São Paulo", "Zürich", "Kraków", "Þingvellir", "Dvořák", "Ærø", "œuvre", "İstanbul",
            "straße", "GROẞE", "Ωmega", "ΣΟΦΟΣ σοφός", "Ⅻ o'clock", "ﬁnal ﬂow", "Kelvin K",
            "e\u0301te\u0301", "A\u030angstro\u0308m", "\u1100\u1161\u11a8", "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３"]
SCRIPTS = ["猫が窓辺で眠っている", "一只在月光下的猫", "고양이가 창가에서 자고 있다", "Кошка спит на окне",
           "Η γάτα κοιμάται", "القطة نائمة على النافذة", "החתול ישן", "बिल्ली खिड़की पर सो रही है",
           "แมวนอนอยู่ที่หน้าต่าง", "カタカナとひらがな", "ｶﾀｶﾅ", "漢字和かな混じり文", "Ελληνικά ΑΒΓ",
           "ქართული", "Հայերեն", "தமிழ்", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "𠜎𠜱𠝹"]
EMOJI = ["😀", "🐱", "🐈‍⬛", "👩‍👩‍👧‍👦", "👍🏽", "🇫🇷", "🇯🇵", "❤️", "☕", "🔥🔥🔥", "✨", "🏳️‍🌈",
         "1️⃣", "🧑🏿‍🚀", "©", "™", "♥", "★", "→", "∞", "√2", "°C"]
PUNCT = ["!", "?", "...", "…", ",", ";", ":", "-", "--", "—", "–", "(", ")", "[", "]", "{", "}",
         "\"", "'", "`", "«", "»", "“", "”", "‘", "’", "/", "\\", "|", "@", "#", "$", "%", "^",
         "&", "*", "+", "=", "<", ">", "~", "_", "¿", "¡", "§", "¶", "•", "·", "„", "‹", "›"]
NUMBERS = ["0", "7", "42", "1234", "3.14159", "1,000,000", "-273.15", "1e-9", "0x1F", "½", "¾",
           "²", "³", "٣٤٥", "१२३", "１２３", "Ⅻ", "①②③", "2024-01-31", "12:30", "50%", "$9.99",
           "№5", "v2.0", "x86_64"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2003", "\u200b", "\u2028",
          "\u0085", "\u000b", "\u000c", "\u001f", " \t \n "]
CONTRACTIONS = ["it's", "don't", "we're", "they've", "I'm", "you'll", "he'd", "IT'S", "WE'LL",
                "O'Neil", "rock'n'roll", "'s", "''", "'", "’s"]
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|ENDOFTEXT|>", "<|endoftext|><|endoftext|>",
            "<extra_id_0>", "<extra_id_7>", "<extra_id_99>", "</s>", "<pad>", "<unk>", "<s>",
            "&amp;", "&lt;b&gt;", "<b>bold</b>", "<br/>"]
CONTROLS = ["\x00", "\x01", "\x7f", "\u200d", "\ufeff", "\ufffd", "\u0301", "\U000e0001"]


def random_codepoint(rng):
    """An assigned code point (in this Python's Unicode tables) that is not a surrogate."""
    while True:
        r = rng.random()
        if r < 0.6:
            cp = rng.randrange(0x20, 0x3000)
        elif r < 0.85:
            cp = rng.randrange(0x3000, 0x10000)
        else:
            cp = rng.randrange(0x10000, 0x30000)
        c = chr(cp)
        if unicodedata.category(c) not in ("Cn", "Cs", "Co"):
            return c


def piece(rng):
    kind = rng.random()
    if kind < 0.40:
        w = rng.choice(WORDS)
        case = rng.random()
        if case < 0.15:
            w = w.upper()
        elif case < 0.3:
            w = w.capitalize()
        return w
    pools = [ACCENTED, SCRIPTS, EMOJI, PUNCT, NUMBERS, CONTRACTIONS, SPECIALS, CONTROLS]
    weights = [10, 10, 8, 12, 10, 6, 3, 2]
    pool = rng.choices(pools, weights)[0]
    return rng.choice(pool)


def caption(rng, n_pieces):
    parts = []
    for _ in range(n_pieces):
        parts.append(piece(rng))
        r = rng.random()
        if r < 0.7:
            parts.append(" ")
        elif r < 0.85:
            parts.append("")
        else:
            parts.append(rng.choice(SPACES))
    return "".join(parts)


def make_captions(seed, count):
    rng = random.Random(seed)
    out = ["", " ", "   ", "\t\n", "a", "A", "!", "'", "0", "a photo of a cat",
           "A  photo\tof a\n\ncat  ", "  leading and trailing spaces  "]
    out.append(" ".join(rng.choice(WORDS) for _ in range(600)))           # very long
    out.append("".join(rng.choice(WORDS) for _ in range(40)))              # one long word
    out.append("!" * 300)
    out.append("😀" * 100)
    out.append("猫" * 200)
    out.append("1234567890" * 20)
    for _ in range(60):  # random code points, alone and mixed
        out.append("".join(random_codepoint(rng) for _ in range(rng.randrange(1, 25))))
    while len(out) < count:
        r = rng.random()
        if r < 0.05:
            n = rng.randrange(60, 200)   # longer than 77 tokens
        elif r < 0.5:
            n = rng.randrange(1, 8)
        else:
            n = rng.randrange(8, 30)
        out.append(caption(rng, n))
    return out


def unicode_sweep(per_caption=48):
    """Every code point but the surrogates and the private-use planes, per_caption to a caption,
    each between two letters ("a<c>b"), so a classification difference shows up in its caption."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and c < 0xF0000]
    out = []
    for i in range(0, len(cps), per_caption):
        out.append(" ".join("a" + chr(c) + "b" for c in cps[i:i + per_caption]))
    return out


def bytes_to_unicode():
    """GPT-2's table: printable bytes map to themselves, the others to 256 + n in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def hf_files_from_bpe_gz(bpe_path, folder):
    """vocab.json + merges.txt as open_clip builds its vocabulary from the gzip'd merges."""
    lines = gzip.open(bpe_path).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1:49152 - 256 - 2 + 1]]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(" ".join(m) + "\n")


def open_clip_pad(ids, context_length=77, sot=49406, eot=49407):
    """open_clip's SimpleTokenizer.__call__ rule on already-encoded ids (with sot/eot)."""
    tokens = list(ids)
    if len(tokens) > context_length:
        tokens = tokens[:context_length]
        tokens[-1] = eot
    return tokens + [0] * (context_length - len(tokens))


def ids_line(ids):
    return " ".join(str(i) for i in ids) if ids else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bpe", required=True, help="bpe_simple_vocab_16e6.txt.gz of open_clip")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--count", type=int, default=1200)
    ap.add_argument("--unicode-sweep", action="store_true",
                    help="captions covering every code point instead (large: write to a scratch --out and run "
                         "the tests with FLAME_TOKENIZER_DATA=that folder)")
    args = ap.parse_args()

    import sentencepiece as spm
    from transformers import CLIPTokenizer, T5TokenizerFast

    os.makedirs(args.out, exist_ok=True)
    bpe_copy = os.path.join(args.out, "bpe_simple_vocab_16e6.txt.gz")
    if not os.path.exists(bpe_copy):
        shutil.copyfile(args.bpe, bpe_copy)
    captions = unicode_sweep() if args.unicode_sweep else make_captions(1234, args.count)
    with open(os.path.join(args.out, "captions.jsonl"), "w", encoding="utf-8") as f:
        for c in captions:
            f.write(json.dumps(c) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        hf_files_from_bpe_gz(args.bpe, tmp)
        clip_l = CLIPTokenizer.from_pretrained(tmp)
        clip_g = CLIPTokenizer.from_pretrained(tmp, pad_token="!")
        assert clip_l.bos_token_id == 49406 and clip_l.eos_token_id == 49407, \
            (clip_l.bos_token_id, clip_l.eos_token_id)
        assert clip_l.pad_token_id == 49407 and clip_g.pad_token_id == 0
        with open(os.path.join(args.out, "clip_ids.txt"), "w") as f:
            for c in captions:
                f.write(ids_line(clip_l(c)["input_ids"]) + "\n")
        with open(os.path.join(args.out, "clip_padded.txt"), "w") as f:
            for i, c in enumerate(captions):
                if i % 10:
                    continue
                el = clip_l(c, padding="max_length", truncation=True, max_length=77)
                eg = clip_g(c, padding="max_length", truncation=True, max_length=77)
                full = clip_l(c)["input_ids"]
                og = open_clip_pad(full)
                og_mask = [1] * min(len(full), 77) + [0] * (77 - min(len(full), 77))
                f.write("|".join(ids_line(x) for x in (el["input_ids"], el["attention_mask"], og, og_mask,
                                                      eg["input_ids"], eg["attention_mask"])) + "\n")

    # T5: a unigram model trained on a second corpus (another seed) with T5's settings.
    train = make_captions(99, 4000)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train), model_writer=model, model_type="unigram", vocab_size=1000,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name="nmt_nfkc",
        character_coverage=0.995, num_threads=1, seed_sentencepiece_size=100000,
        input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
    model_path = os.path.join(args.out, "t5_test.model")
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "spiece.model"), "wb") as f:
            f.write(model.getvalue())
        t5 = T5TokenizerFast.from_pretrained(tmp)
        assert t5.eos_token_id == 1 and t5.pad_token_id == 0 and t5.unk_token_id == 2
        with open(os.path.join(args.out, "t5_ids.txt"), "w") as f:
            for c in captions:
                f.write(ids_line(t5(c)["input_ids"]) + "\n")
        with open(os.path.join(args.out, "t5_padded.txt"), "w") as f:
            for i, c in enumerate(captions):
                if i % 10:
                    continue
                e = t5(c, padding="max_length", truncation=True, max_length=32)
                f.write(ids_line(e["input_ids"]) + "|" + ids_line(e["attention_mask"]) + "\n")
    print(f"wrote {len(captions)} captions to {args.out}")


if __name__ == "__main__":
    main()
