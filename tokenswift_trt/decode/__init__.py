"""The TokenSwift decoding algorithm: the loop, its stages (drafting, the trie, verification and
acceptance, n-grams), sampling's acceptance rules, the tuner, journals and request admission."""
