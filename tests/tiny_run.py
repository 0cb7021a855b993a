"""The tiny model and training loop the watch's tests share: an embedding, LayerNorm gains and a linear head trained
to predict the next of 12 tokens, so that rows 12..19 of the embedding never get a gradient."""

import torch


def tiny_model(seed=0, norms=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(20, 8), *[torch.nn.LayerNorm(8) for _ in range(norms)],
                               torch.nn.Linear(8, 20))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 12, (16,), generator=g) for _ in range(n)]   # tokens 12..19 never occur


def train(model, opt, steps, sched=None, seed=0, each=None):
    for t, x in enumerate(batches(steps, seed)):
        loss = torch.nn.functional.cross_entropy(model(x).float(), (x + 1) % 12)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        if each is not None:
            each(t)
