"""The offline GPU check (`ctxgate bench gpu`): the carried wheels, random-weight models at real
shapes, HF parity, W1-W3 against HF `generate` and the roofline, and end to end through the gateway."""
