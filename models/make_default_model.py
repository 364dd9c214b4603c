"""Build the tiny Qwen3-family model shipped in `models/default_model/`.

The embedded model lets the README demo, the tests and CI run with no download. It is a
real (if very small) language model: this script writes an English corpus from the text
and the story grammar below, trains a byte-level BPE tokenizer on it, trains a ~0.9M
parameter Qwen3 model on it for a few CPU minutes with torch + transformers, and saves
everything in the HF layout (so transformers and `jaxoverlap.models.loader` both load it):

    config.json  generation_config.json  model.safetensors (bf16)
    tokenizer.json  tokenizer_config.json

Run (from the repo root; needs the dev extras, i.e. torch and transformers):

    python -m jaxoverlap.models.make_default_model            # writes models/default_model/
    python -m jaxoverlap.models.make_default_model --out DIR --steps 50   # a quick try

Determinism: the corpus and the tokenizer are the same bytes on every machine. Training is
seeded and single-process with a fixed torch thread count (`--threads`, default 2), so a
rerun on the same machine and software reproduces the weights bit for bit; other CPUs or
torch builds may round differently and give slightly different (equally good) weights.

All text below was written for this project.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

SEED = 1234
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS = "<|endoftext|>"

# The model: Qwen3 (qk-norm, no qkv bias), tied embeddings like the small Qwen3 releases.
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)

# --------------------------------------------------------------------------------------
# Corpus: hand-written paragraphs
# --------------------------------------------------------------------------------------

PARAGRAPHS = [
    """The sea is never quiet. In the morning the water is gray and calm, and small boats go out \
past the rocks to catch fish. By noon the wind comes up, the waves turn white at the top, and \
the gulls cry over the harbor. In the evening the boats come back, and the people of the town \
walk down to the water to see what the day has brought.""",
    """Every Saturday the market fills the old square. There are tables of apples and pears, \
baskets of bread, jars of honey, and wheels of yellow cheese. A man sells warm soup from a big \
pot, and a woman plays the violin near the fountain. Children run between the stalls, and \
everyone talks at once, so the whole square sounds like a happy song.""",
    """There are four seasons in the year. In spring the trees grow new leaves and the first \
flowers open. Summer is long and warm, and the days are bright until late in the evening. In \
autumn the leaves turn red and gold and fall to the ground. Winter is cold and dark, and \
sometimes snow covers the hills and the roofs of the houses.""",
    """To make bread, you mix flour, water, salt, and a little yeast in a large bowl. Then you \
press and fold the dough for a few minutes until it is smooth. You cover the bowl and wait, and \
the dough slowly grows to twice its size. At last you shape it into a loaf and bake it in a hot \
oven until the crust is brown and the kitchen smells wonderful.""",
    """On a clear night, far from the lights of the city, you can see thousands of stars. Some \
are bright and some are so faint that you can only see them if you look a little to the side. \
The moon moves across the sky during the night, and its shape changes from one week to the \
next. People have watched the sky like this for as long as there have been people.""",
    """The train leaves the station at seven in the morning. It rolls slowly past the houses \
and the factories, and then it runs faster through fields and small villages. Some people read, \
some sleep, and some look out of the window at the cows and the rivers. After three hours the \
train reaches the mountains, and the air becomes cool and fresh.""",
    """A garden needs time and care. You have to turn the soil, plant the seeds at the right \
depth, and water them when the weather is dry. Weeds grow faster than anything else, so you \
pull them out every few days. If you are patient, the garden gives you beans, tomatoes, \
carrots, and flowers, and the bees come to visit all summer long.""",
    """Rain began to fall in the afternoon. At first there were only a few heavy drops, and \
then the whole street was wet and shining. People opened their umbrellas and walked quickly \
under the trees. The water ran along the sides of the road and into the drains, and the air \
smelled of earth and stone. When the rain stopped, a rainbow stood over the hills.""",
    """A computer is a machine that follows instructions. It can add numbers, store words and \
pictures, and send messages to other computers very quickly. The instructions are called a \
program, and people who write programs are called programmers. A good program is clear and \
careful, because a computer does exactly what it is told, even when that is a mistake.""",
    """The river starts as a small stream high in the mountains. It runs down between the rocks, \
and other streams join it on the way. In the valley it becomes wide and slow, and it passes \
farms, bridges, and towns. At the end of its long journey the river meets the sea, and its \
fresh water mixes with the salt water of the waves.""",
    """Music can change the way a room feels. A slow song makes people quiet and thoughtful, \
and a fast song makes them want to dance. Some people play the piano or the guitar, and others \
sing or play the drums. When many people play together, each one listens to the others, and \
the music becomes more than any of them could make alone.""",
    """The library is the quietest place in town. Its shelves are full of books about history, \
animals, far countries, and the stars. An old librarian helps people find what they are looking \
for, and she knows where almost every book is kept. On rainy days children sit on the soft \
chairs by the window and read stories until their parents come to take them home.""",
    """Bees live together in a hive. Each bee has a job: some build the wax cells, some care \
for the young, and some fly out to the flowers to collect nectar. The bees turn the nectar into \
honey and store it for the winter. A single bee is very small, but a hive of bees can do \
great things because they all work together.""",
    """The old lighthouse stands at the end of the point. For many years a keeper lived there \
and climbed the stairs every evening to light the lamp. The light turned slowly all night, so \
that ships could see the rocks and find the way into the harbor. Today the lamp works by \
itself, but people still walk out to the lighthouse to watch the sunset.""",
    """Learning something new takes practice. The first time you try to ride a bicycle, you \
may fall, and the first time you play a song, it may sound wrong. But every time you try \
again, it becomes a little easier. After many days of practice, the thing that was hard \
becomes simple, and you can hardly remember why it seemed so difficult.""",
]

QUESTIONS = [
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("Where does the sun rise?", "The sun rises in the east and sets in the west."),
    ("What do bees make?", "Bees make honey from the nectar of flowers."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do plants need to grow?", "Plants need water, light, and good soil to grow."),
    ("What happens to water when it gets very cold?", "When water gets very cold, it turns into ice."),
    ("Why do people use umbrellas?", "People use umbrellas to stay dry when it rains."),
    ("What is a library?", "A library is a place where people can read and borrow books."),
    ("How many seasons are in a year?", "There are four seasons: spring, summer, autumn, and winter."),
    ("What does a baker make?", "A baker makes bread, cakes, and other good things to eat."),
    ("What is the moon?", "The moon is a large round rock that moves around the earth."),
    ("Where do fish live?", "Fish live in water, in rivers, lakes, and the sea."),
    ("What is a computer program?", "A program is a list of instructions that a computer follows."),
    ("Why do leaves fall in autumn?", "In autumn the days grow short and cold, so many trees drop their leaves."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("What do you call a baby dog?", "A baby dog is called a puppy."),
]

# --------------------------------------------------------------------------------------
# Corpus: a small story grammar (seeded, so the same stories every run)
# --------------------------------------------------------------------------------------

NAMES = [("Mia", "she"), ("Tom", "he"), ("Lena", "she"), ("Sam", "he"), ("Ivy", "she"),
         ("Ben", "he"), ("Nora", "she"), ("Leo", "he"), ("Rosa", "she"), ("Finn", "he"),
         ("Ada", "she"), ("Max", "he"), ("Zoe", "she"), ("Omar", "he"), ("Ella", "she"),
         ("Kai", "he"), ("Lily", "she"), ("Jack", "he"), ("Anna", "she"), ("Theo", "he")]
KINDS = ["fox", "rabbit", "girl", "boy", "cat", "dog", "bear", "mouse", "duck", "squirrel",
         "owl", "frog", "turtle", "horse", "robot", "dragon"]
ADJS = ["little", "brave", "curious", "sleepy", "clever", "kind", "shy", "happy", "young",
        "small", "gentle", "busy", "quiet", "funny", "lonely", "careful"]
HOMES = ["in a small house near the forest", "by the edge of a quiet lake", "in a village between two hills",
         "at the top of a tall tree", "in a little town by the sea", "in a warm hole under an old oak",
         "on a farm with a red barn", "in a busy city full of lights", "near a river with a stone bridge",
         "in a cottage at the end of a long road"]
ACTIVITIES = ["play in the garden", "read old books", "watch the stars at night", "bake bread",
              "swim in the lake", "draw pictures of birds", "climb tall trees", "sing songs by the window",
              "collect shiny stones", "build boats out of wood", "run through the fields",
              "listen to the rain", "plant flowers", "ride a bicycle down the hill", "fly a kite"]
TIMES = ["morning", "afternoon", "evening", "day", "night"]
SEASONS = ["spring", "summer", "autumn", "winter"]
OBJECTS = [("a shiny key", "key"), ("a tiny boat", "boat"), ("a red kite", "kite"), ("an old map", "map"),
           ("a blue stone", "stone"), ("a wooden box", "box"), ("a golden feather", "feather"),
           ("a small bell", "bell"), ("a glass bottle with a letter inside", "letter"),
           ("a strange egg", "egg"), ("a silver ring", "ring"), ("a book with no title", "book")]
SPOTS = ["under a big tree", "near the river", "behind the old house", "in the tall grass",
         "on the way to school", "at the bottom of the garden", "inside a hollow log",
         "on the sandy beach", "next to the well", "in the corner of the attic"]
FRIENDS = [("Grandma", "her"), ("an old owl", "its"), ("a wise turtle", "its"), ("the baker", "his"),
           ("a friendly crow", "its"), ("the teacher", "her"), ("a kind old man", "his"),
           ("a little robot", "its")]
MEANINGS = {
    "key": "This key opens the door of the old tower on the hill",
    "boat": "This boat belongs to the children who live across the lake",
    "kite": "The wind must have carried this kite from the next village",
    "map": "This map shows the way to a hidden lake in the mountains",
    "stone": "Stones like this one come from the bottom of the river",
    "box": "There is something inside this box, but it is locked",
    "feather": "This feather fell from a very rare bird",
    "bell": "This bell was once on the neck of a goat",
    "letter": "Someone far away wrote this letter and gave it to the sea",
    "egg": "This egg will hatch soon, so we must keep it warm",
    "ring": "Someone in the village must be looking for this ring",
    "book": "This book is full of old songs that nobody sings anymore",
}
TROUBLES = [("the sky grew dark and the wind began to blow", "they walked close together and did not stop"),
            ("it began to rain very hard", "they waited under a big tree until the rain was over"),
            ("they came to a river with no bridge", "they found flat stones and stepped across one by one"),
            ("they heard a strange noise in the bushes", "it was only a small hedgehog looking for food"),
            ("the path was blocked by a fallen tree", "they climbed over it slowly and carefully"),
            ("they lost their way in the fog", "they followed the sound of the church bell back to the road")]
HELPERS = [("a bird with a hurt wing", "wrapped the wing in a soft cloth"),
           ("a puppy that was lost and scared", "carried the puppy back to its home"),
           ("a mouse that was hungry and cold", "shared their bread and gave the mouse a warm scarf"),
           ("a duckling looking for its mother", "walked with the duckling to the pond, where its mother was waiting"),
           ("a goat stuck in the mud", "pulled the goat out with a long rope")]
MORALS = ["it is good to help others", "small things can lead to big adventures",
          "friends make every road shorter", "being brave does not mean you are never afraid",
          "kindness always comes back", "patience is a kind of strength",
          "the best treasures are the ones you share", "asking for help is not a weakness"]
ENDINGS = ["When {name} came home, {pron} was tired but happy.",
           "That night, {name} fell asleep with a smile.",
           "From that day on, {name} and {friend} were the best of friends.",
           "{Name} never forgot that {season} {time}.",
           "And every {season} after that, {name} went back to the same place."]


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def make_story(rng: random.Random) -> str:
    name, pron = rng.choice(NAMES)
    kind = rng.choice([k for k in KINDS if (k, pron) not in (("girl", "he"), ("boy", "she"))])
    adj = rng.choice(ADJS)
    article = "an" if adj[0] in "aeiou" else "a"
    home, activity = rng.choice(HOMES), rng.choice(ACTIVITIES)
    season, time_ = rng.choice(SEASONS), rng.choice(TIMES)
    obj, obj_key = rng.choice(OBJECTS)
    spot = rng.choice(SPOTS)
    friend, _ = rng.choice(FRIENDS)
    poss = "her" if pron == "she" else "his"
    v = dict(name=name, Name=name, pron=pron, Pron=_cap(pron), friend=friend, season=season, time=time_)

    opening = rng.choice([
        f"Once upon a time, there was {article} {adj} {kind} named {name}. {_cap(pron)} lived {home}.",
        f"Long ago, {home}, lived {article} {adj} {kind} called {name}.",
        f"{name} was {article} {adj} {kind} who lived {home}.",
        f"One {season} {time_}, {article} {adj} {kind} named {name} woke up early.",
    ])
    s = [opening, f"{_cap(pron)} loved to {activity}."]
    s.append(rng.choice([
        f"One {time_}, {name} found {obj} {spot}.",
        f"One {season} {time_}, while {pron} was walking, {name} saw {obj} {spot}.",
        f"Then, {spot}, {name} noticed {obj}.",
    ]))
    s.append(rng.choice([
        f"{_cap(pron)} picked it up and looked at it for a long time.",
        f"{_cap(pron)} held it carefully in {poss} hands.",
        f"\"What is this?\" asked {name}.",
        f"\"I wonder where this came from,\" said {name}.",
    ]))
    s.append(f"{name} decided to show it to {friend}.")
    s.append(f"\"{MEANINGS[obj_key]},\" said {friend}.")
    if rng.random() < 0.6:
        trouble, solution = rng.choice(TROUBLES)
        s.append(f"So {name} and {friend} set off together. On the way, {trouble}, but {solution}.")
    if rng.random() < 0.6:
        creature, help_ = rng.choice(HELPERS)
        s.append(f"Soon they met {creature}. {name} and {friend} {help_}.")
    s.append(rng.choice(ENDINGS).format(**v))
    if rng.random() < 0.7:
        s.append(f"{name} learned that {rng.choice(MORALS)}.")
    if rng.random() < 0.3:
        s.append("The end.")
    return " ".join(s)


def make_qa(rng: random.Random) -> str:
    pairs = rng.sample(QUESTIONS, rng.randint(2, 4))
    return "\n\n".join(f"Question: {q}\nAnswer: {a}" for q, a in pairs)


def build_corpus(seed: int = SEED, n_stories: int = 3000, n_qa: int = 300, paragraph_repeats: int = 8) -> list[str]:
    """The training documents, in a seeded order (each is later followed by <|endoftext|>)."""
    rng = random.Random(seed)
    docs = [make_story(rng) for _ in range(n_stories)]
    docs += [make_qa(rng) for _ in range(n_qa)]
    docs += PARAGRAPHS * paragraph_repeats
    rng.shuffle(docs)
    return docs


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # GPT-2 style byte-level BPE: any text is encodable, nothing is ever <unk>.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def train_model(token_stream, *, steps: int, batch: int, seq_len: int, lr: float, threads: int, log_every: int = 50):
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    cfg = Qwen3Config(**MODEL_CONFIG, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        # Linear warmup, then cosine decay to a tenth of the peak.
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    stream = torch.from_numpy(np.asarray(token_stream, dtype=np.int64))
    rng = np.random.default_rng(SEED)
    start = time.time()
    for step in range(steps):
        offsets = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        x = torch.stack([stream[o : o + seq_len] for o in offsets])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss  # labels are shifted inside the model
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr_at(step):.2e}  {time.time() - start:.0f}s", flush=True)
    model.eval()
    return model


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def build(out: str, *, steps: int, batch: int, seq_len: int, lr: float, threads: int) -> None:
    import torch

    docs = build_corpus()
    tok = train_tokenizer(docs)
    eos_id = tok.token_to_id(EOS)
    assert eos_id == MODEL_CONFIG["eos_token_id"], eos_id
    stream = []
    for ids in tok.encode_batch(docs):
        stream.extend(ids.ids)
        stream.append(eos_id)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs))} characters, {len(stream)} tokens")

    model = train_model(stream, steps=steps, batch=batch, seq_len=seq_len, lr=lr, threads=threads)

    os.makedirs(out, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "pad_token": EOS,
            "bos_token": None,
            "add_bos_token": False,
            "model_max_length": MODEL_CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        }, f, indent=2)
        f.write("\n")

    # A taste of what the demo will print.
    model = model.float()
    for prompt in ["Once upon a time", "The sea", "Question: What do bees make?\nAnswer:"]:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=48, do_sample=False)
        print(repr(prompt + tok.decode(gen[0, ids.shape[1]:].tolist())))
    total = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(here, "default_model"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    build(args.out, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, threads=args.threads)


if __name__ == "__main__":
    main()
