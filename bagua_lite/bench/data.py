"""The benchmark's data: synthetic batches for timing, and the learnable tasks of convergence mode.

Throughput mode (``make_batches``) needs batches of the right shape whose loss is finite; nothing is
learnt in ten steps. Convergence mode (``make_task``) needs a task whose held-out metric means something,
the same for every algorithm (same seed) and on every rank's view:

``digits``   scikit-learn's digits (ships with it, no download; ``mlp_digits``): an 80/20 split of the
             1797 8x8 images, the training part sharded by rank and reshuffled every epoch (seeded), the
             359 held-out images for the metric. The demo's split (``digits_shards``).
``teacher``  every other classifier: random inputs of the model's input shape (``_inputs``), labelled by a
             fixed random *teacher* network (flat inputs: 64 ReLU units then 10 logits; images: 16 random 3x3
             filters, ReLU, the mean over the image, 10 logits: translation-invariant, as a CNN is), its logits standardised per class on
             4096 calibration inputs so that no class dominates. The labels are a deterministic function
             of the inputs, so accuracy can climb far above chance (0.1); a fixed held-out set of
             ``eval_samples`` inputs (seeded apart from the training stream) measures it.
``markov``   the language model (``gpt_small``): token sequences from a fixed random Markov chain in which
             each token is followed by one of 4 tokens (Dirichlet(1) probabilities). The best possible
             next-token loss is the chain's entropy rate (``MarkovTask.entropy``, about 1 nat against
             log 256 = 5.5 for a uniform guess); accuracy tops out at the mean of each token's most likely
             successor's probability.

Every rank's training stream is its own (seeded by rank); the held-out set is the same on every rank.
"""
import math
import os

import torch
import torch.nn.functional as F


def loss_fn(out, y):
    """Cross-entropy of a classifier's (batch, classes) or a language model's (batch, seq, vocab) logits."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_batches(spec, batch_size, n_batches, rank, seed=0):
    """Synthetic batches for timing: random inputs per rank labelled by a fixed random linear map (token
    models: random tokens, the targets their next tokens)."""
    gr = torch.Generator().manual_seed(seed + 1000 + rank)
    if spec.vocab:
        out = []
        for _ in range(n_batches):
            seq = torch.randint(0, spec.vocab, (batch_size, spec.shape[0] + 1), generator=gr)
            out.append((seq[:, :-1], seq[:, 1:]))
        return out
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(math.prod(spec.shape), 10, generator=g)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, *spec.shape, generator=gr)
        out.append((x, (x.reshape(batch_size, -1) @ teacher).argmax(1)))
    return out


# ---- convergence tasks -------------------------------------------------------------------------------------
class Task:
    """``batch(step)``: this rank's training batch for global step ``step`` (steps come in order from
    0 after ``reset()``, which every cell calls so that every algorithm sees the same stream);
    ``eval_x``, ``eval_y``: the held-out set, identical on every rank."""

    eval_x = eval_y = None

    def reset(self):
        pass

    def batch(self, step):
        raise NotImplementedError


def _load_digits():
    """scikit-learn's ``load_digits(return_X_y=True)``: the file it reads, read as it reads it, without
    importing scikit-learn (2.2 s of every rank's start, where the file takes 0.05 s)."""
    import importlib.util  # lazy, as numpy: only the digits task needs them
    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits task reads scikit-learn's digits data set: pip install scikit-learn "
                          "(scripts/install.sh benchmark installs it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def digits_shards(rank, world_size, seed=0):
    """The digits data set (ships with scikit-learn), 80/20 split, training set sharded by rank."""
    x, y = _load_digits()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    return x[n_test:][rank::world_size], y[n_test:][rank::world_size], x[:n_test], y[:n_test]


class DigitsTask(Task):
    def __init__(self, rank, world, batch_size, seed=0):
        self.x, self.y, self.eval_x, self.eval_y = digits_shards(rank, world, seed)
        n_train = 1797 - 1797 // 5
        # the same number of steps per epoch on every rank (the shards differ by at most one sample)
        self.per_epoch = max(1, (n_train // world) // batch_size)
        self.batch_size, self.rank, self.seed = batch_size, rank, seed
        self._epoch, self._perm = -1, None

    def batch(self, step):
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + 7919 * (epoch + 1) + self.rank)
            self._epoch, self._perm = epoch, torch.randperm(len(self.x), generator=g)
        idx = self._perm[i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[idx], self.y[idx]


def _teacher(shape, g):
    """A fixed random network of the inputs' kind (see the module docstring); returns x -> logits."""
    if len(shape) == 3:
        # translation-invariant, as a CNN's global pooling is: 16 random 3x3 filters, ReLU, the mean over
        # the image, then 10 logits
        c = shape[0]
        w = torch.randn(16, c, 3, 3, generator=g) / math.sqrt(9 * c)
        v = torch.randn(16, 10, generator=g) / 4.0
        return lambda x: F.relu(F.conv2d(x, w, padding=1)).mean((2, 3)) @ v
    dim = math.prod(shape)
    w1 = torch.randn(dim, 64, generator=g) / math.sqrt(dim)
    w2 = torch.randn(64, 10, generator=g) / 8.0
    return lambda x: F.relu(x.reshape(len(x), -1) @ w1) @ w2


def _inputs(n, shape, g):
    """Random inputs: N(0, 1) vectors; images are a coarse 4x4 N(0, 1) pattern per channel, blown up
    to full size, plus N(0, 0.5^2) pixel noise (white noise alone would leave no image structure for a
    CNN to find: its 4x4 block means have a standard deviation of 1/8)."""
    if len(shape) == 3:
        coarse = torch.randn(n, shape[0], 4, 4, generator=g)
        return F.interpolate(coarse, size=shape[1:], mode="nearest") + 0.5 * torch.randn(n, *shape, generator=g)
    return torch.randn(n, *shape, generator=g)


class TeacherTask(Task):
    def __init__(self, shape, rank, batch_size, eval_samples, seed=0):
        g = torch.Generator().manual_seed(seed + 101)
        raw = _teacher(shape, g)
        with torch.no_grad():
            calib = raw(_inputs(4096, shape, g))
        mean, std = calib.mean(0), calib.std(0)
        self.label = lambda x: ((raw(x) - mean) / std).argmax(1)
        self.shape, self.batch_size = tuple(shape), batch_size
        ge = torch.Generator().manual_seed(seed + 202)
        with torch.no_grad():
            self.eval_x = _inputs(eval_samples, shape, ge)
            self.eval_y = self.label(self.eval_x)
        self._seed = seed + 10_000 + rank
        self.reset()

    def reset(self):
        self._g = torch.Generator().manual_seed(self._seed)

    def batch(self, step):
        x = _inputs(self.batch_size, self.shape, self._g)
        with torch.no_grad():
            return x, self.label(x)


class MarkovTask(Task):
    BRANCH = 4

    def __init__(self, vocab, seq_len, rank, batch_size, eval_samples, seed=0):
        g = torch.Generator().manual_seed(seed + 303)
        self.next = torch.stack([torch.randperm(vocab, generator=g)[:self.BRANCH] for _ in range(vocab)])
        p = -torch.log(torch.rand(vocab, self.BRANCH, generator=g))  # Dirichlet(1, ..., 1)
        self.probs = p / p.sum(1, keepdim=True)
        # the chain's stationary distribution (power iteration), for its entropy rate
        trans = torch.zeros(vocab, vocab, dtype=torch.float64)
        trans.scatter_add_(1, self.next, self.probs.double())
        pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(500):
            pi = pi @ trans
        #: the lowest possible next-token loss (nats) and the highest possible next-token accuracy
        self.entropy = float(-(pi[:, None] * self.probs * self.probs.log()).sum())
        self.best_accuracy = float((pi * self.probs.double().max(1).values).sum())
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size
        self.eval_x, self.eval_y = self._sample(eval_samples, torch.Generator().manual_seed(seed + 404))
        self._seed = seed + 20_000 + rank
        self.reset()

    def reset(self):
        self._g = torch.Generator().manual_seed(self._seed)

    def _sample(self, n, g):
        tok = torch.randint(0, self.vocab, (n,), generator=g)
        seq = [tok]
        for _ in range(self.seq_len):
            choice = torch.multinomial(self.probs[tok], 1, generator=g).squeeze(1)
            tok = self.next[tok, choice]
            seq.append(tok)
        seq = torch.stack(seq, 1)
        return seq[:, :-1], seq[:, 1:]

    def batch(self, step):
        return self._sample(self.batch_size, self._g)


def make_task(spec, rank, world, batch_size, eval_samples, seed=0):
    """The convergence task of a model (its ``InputSpec.task``), this rank's view."""
    if spec.task == "digits":
        return DigitsTask(rank, world, batch_size, seed)
    if spec.task == "markov":
        return MarkovTask(spec.vocab, spec.shape[0], rank, batch_size, eval_samples, seed)
    if spec.task == "teacher":
        return TeacherTask(spec.shape, rank, batch_size, eval_samples, seed)
    raise ValueError(f"unknown task {spec.task!r}; known: digits, teacher, markov")


def evaluate(net, task, chunk=256):
    """(accuracy, mean loss) of ``net`` on the task's held-out set, in eval mode, no gradients."""
    was = net.training
    net.eval()
    correct, loss, n = 0.0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(task.eval_x), chunk):
            x, y = task.eval_x[i:i + chunk], task.eval_y[i:i + chunk]
            out = net(x)
            loss += float(loss_fn(out, y)) * y.numel()
            correct += float((out.argmax(-1) == y).sum())
            n += y.numel()
    net.train(was)
    return correct / n, loss / n
