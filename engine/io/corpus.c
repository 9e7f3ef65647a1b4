/* corpus.c — the embedded default corpus: English-like text from a small grammar.
 *
 * The text alternates prose paragraphs (mostly past tense, with quoted speech) and
 * scenes of a play (a heading, "Enter A and B.", then speeches under a speaker's name in
 * capitals followed by ':', mostly present tense, often addressing the previous
 * speaker). Sentences come from a recursive grammar over a few hundred words: noun
 * phrases with determiners that agree in number ("a"/"an" chosen by the next word),
 * verbs conjugated for person and tense, questions with do-support, imperatives,
 * subordinate and compound clauses. Word choice is skewed toward the front of each list,
 * roughly as word frequencies are. That gives structure at every level (spelling,
 * agreement, line layout, who speaks next) without repeating itself.
 *
 * Invariants: the bytes depend only on (seed, nbytes) and the first k bytes are the same
 * for every nbytes >= k: the generator runs on its own integer PRNG (xoshiro256**
 * seeded by splitmix64) with integer arithmetic only, and output simply stops when the
 * buffer is full. Every byte is printable ASCII or '\n'. */
#include "engine/io/corpus.h"

#include <stdlib.h>
#include <string.h>

#define N(a) ((uint32_t)(sizeof(a) / sizeof((a)[0])))

enum { P1S, P2, P3S, P1P, P3P };  /* grammatical person and number */
enum { PAST, PRES, BASE };         /* verb forms a clause can ask for */
enum { VT = 1, VI = 2, VC = 4, VM = 8 }; /* transitive, intransitive, "that" clause, motion */

typedef struct noun { const char *sg, *pl; } noun;
typedef struct verb { const char *base, *s, *past, *ing; int kind; } verb;

static const noun k_people[] = {
    {"king", "kings"}, {"queen", "queens"}, {"lord", "lords"}, {"lady", "ladies"},
    {"man", "men"}, {"woman", "women"}, {"friend", "friends"}, {"child", "children"},
    {"father", "fathers"}, {"mother", "mothers"}, {"brother", "brothers"},
    {"sister", "sisters"}, {"son", "sons"}, {"daughter", "daughters"},
    {"servant", "servants"}, {"soldier", "soldiers"}, {"captain", "captains"},
    {"knight", "knights"}, {"duke", "dukes"}, {"prince", "princes"}, {"fool", "fools"},
    {"stranger", "strangers"}, {"shepherd", "shepherds"}, {"merchant", "merchants"},
    {"priest", "priests"}, {"sailor", "sailors"}, {"thief", "thieves"}, {"wife", "wives"},
    {"messenger", "messengers"}, {"guard", "guards"}, {"enemy", "enemies"},
    {"traveller", "travellers"}, {"widow", "widows"}, {"maid", "maids"},
};
static const noun k_things[] = {
    {"house", "houses"}, {"heart", "hearts"}, {"hand", "hands"}, {"word", "words"},
    {"letter", "letters"}, {"sword", "swords"}, {"crown", "crowns"}, {"horse", "horses"},
    {"night", "nights"}, {"day", "days"}, {"eye", "eyes"}, {"face", "faces"},
    {"voice", "voices"}, {"name", "names"}, {"song", "songs"}, {"dream", "dreams"},
    {"ring", "rings"}, {"book", "books"}, {"cup", "cups"}, {"fire", "fires"},
    {"light", "lights"}, {"storm", "storms"}, {"star", "stars"}, {"dog", "dogs"},
    {"bird", "birds"}, {"wolf", "wolves"}, {"fox", "foxes"}, {"sheep", "sheep"},
    {"ship", "ships"}, {"key", "keys"}, {"secret", "secrets"}, {"promise", "promises"},
    {"story", "stories"}, {"truth", "truths"}, {"lie", "lies"}, {"war", "wars"},
    {"battle", "battles"}, {"coin", "coins"}, {"flower", "flowers"}, {"stone", "stones"},
    {"apple", "apples"}, {"hour", "hours"}, {"oath", "oaths"}, {"tear", "tears"},
    {"grave", "graves"}, {"candle", "candles"}, {"door", "doors"}, {"year", "years"},
};
static const noun k_places[] = {
    {"house", "houses"}, {"garden", "gardens"}, {"castle", "castles"}, {"city", "cities"},
    {"field", "fields"}, {"forest", "forests"}, {"hall", "halls"}, {"road", "roads"},
    {"river", "rivers"}, {"sea", "seas"}, {"tower", "towers"}, {"church", "churches"},
    {"village", "villages"}, {"court", "courts"}, {"chamber", "chambers"},
    {"market", "markets"}, {"hill", "hills"}, {"valley", "valleys"}, {"bridge", "bridges"},
    {"gate", "gates"}, {"harbour", "harbours"}, {"island", "islands"}, {"camp", "camps"},
};
static const char *const k_names[] = {
    "Rosalind", "Marcus", "Helena", "Oberon", "Viola", "Edmund", "Perdita", "Lucio",
    "Imogen", "Corin", "Beatrice", "Aldric", "Mirabel", "Tobias", "Isolde", "Gregor",
    "Nerissa", "Anselm", "Tamsin", "Orsino",
};
static const char *const k_adjs[] = {
    "old", "good", "young", "great", "poor", "little", "dark", "fair", "sweet", "noble",
    "strange", "gentle", "cold", "true", "false", "wise", "brave", "proud", "long",
    "bright", "quiet", "honest", "cruel", "kind", "weary", "ancient", "empty", "bitter",
    "golden", "silver", "hidden", "broken", "lonely", "wild", "green", "black", "white",
    "red", "deep", "heavy", "swift", "sick", "angry", "happy", "sad", "foolish", "rich",
    "hungry", "secret", "holy", "idle", "open", "loud", "small", "wicked", "faithful",
};
static const char *const k_advs[] = {
    "again", "now", "slowly", "alone", "softly", "tonight", "at once", "in silence",
    "too late", "at last", "away", "together", "forever", "here", "there", "quickly",
};
static const verb k_verbs[] = {
    {"see", "sees", "saw", "seeing", VT | VC},
    {"love", "loves", "loved", "loving", VT},
    {"know", "knows", "knew", "knowing", VT | VC},
    {"go", "goes", "went", "going", VI | VM},
    {"come", "comes", "came", "coming", VI | VM},
    {"find", "finds", "found", "finding", VT},
    {"take", "takes", "took", "taking", VT},
    {"bring", "brings", "brought", "bringing", VT},
    {"hear", "hears", "heard", "hearing", VT | VC},
    {"think", "thinks", "thought", "thinking", VC},
    {"speak", "speaks", "spoke", "speaking", VI},
    {"keep", "keeps", "kept", "keeping", VT},
    {"leave", "leaves", "left", "leaving", VT | VI | VM},
    {"follow", "follows", "followed", "following", VT},
    {"fear", "fears", "feared", "fearing", VT | VC},
    {"call", "calls", "called", "calling", VT},
    {"meet", "meets", "met", "meeting", VT},
    {"hold", "holds", "held", "holding", VT},
    {"seek", "seeks", "sought", "seeking", VT},
    {"trust", "trusts", "trusted", "trusting", VT},
    {"wait", "waits", "waited", "waiting", VI},
    {"sleep", "sleeps", "slept", "sleeping", VI},
    {"weep", "weeps", "wept", "weeping", VI},
    {"laugh", "laughs", "laughed", "laughing", VI},
    {"believe", "believes", "believed", "believing", VT | VC},
    {"swear", "swears", "swore", "swearing", VI | VC},
    {"serve", "serves", "served", "serving", VT},
    {"fight", "fights", "fought", "fighting", VI},
    {"die", "dies", "died", "dying", VI},
    {"save", "saves", "saved", "saving", VT},
    {"lose", "loses", "lost", "losing", VT},
    {"win", "wins", "won", "winning", VT},
    {"remember", "remembers", "remembered", "remembering", VT | VC},
    {"forget", "forgets", "forgot", "forgetting", VT},
    {"hide", "hides", "hid", "hiding", VT},
    {"watch", "watches", "watched", "watching", VT},
    {"carry", "carries", "carried", "carrying", VT},
    {"fall", "falls", "fell", "falling", VI | VM},
    {"rise", "rises", "rose", "rising", VI},
    {"sing", "sings", "sang", "singing", VI},
    {"ride", "rides", "rode", "riding", VI | VM},
    {"run", "runs", "ran", "running", VI | VM},
    {"pray", "prays", "prayed", "praying", VI},
    {"wander", "wanders", "wandered", "wandering", VI | VM},
    {"break", "breaks", "broke", "breaking", VT},
    {"steal", "steals", "stole", "stealing", VT},
    {"send", "sends", "sent", "sending", VT},
    {"build", "builds", "built", "building", VT},
    {"burn", "burns", "burned", "burning", VT | VI},
    {"answer", "answers", "answered", "answering", VT},
    {"hope", "hopes", "hoped", "hoping", VC},
    {"dream", "dreams", "dreamed", "dreaming", VI | VC},
    {"tremble", "trembles", "trembled", "trembling", VI},
    {"return", "returns", "returned", "returning", VI | VM},
};
static const char *const k_at[] = {
    "in", "near", "by", "beyond", "under", "upon", "before", "behind", "at",
};
static const char *const k_motion[] = {
    "to", "from", "through", "across", "into", "toward", "out of", "over",
};
static const char *const k_modals[] = {
    "will", "shall", "must", "may", "cannot", "would", "should", "could",
};
static const char *const k_interj[] = {
    "Alas", "Nay", "O", "Well", "Yes", "No", "Come", "Hark", "Peace", "Indeed",
};
static const char *const k_address[] = {
    "my lord", "my lady", "good sir", "sweet friend", "my brother", "madam",
};
static const char *const k_subord[] = {
    "when", "if", "because", "though", "while", "since", "before", "until",
};
static const char *const k_conj[] = { "and", "but", "for", "so", "yet" };
static const char *const k_wh[] = { "why", "where", "when", "how" };
static const char *const k_said[] = { "said", "cried", "whispered", "answered", "asked" };
static const char *const k_roman[] = {
    "I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI", "XII",
};

typedef struct gen {
    uint8_t *buf;
    size_t n, cap;
    uint64_t s[4];
    int col, wrap;
    int space;  /* a separator is due before the next word */
    int upper;  /* capitalise the next word */
    int quote;  /* open a quotation before the next word */
    int play;   /* inside a scene: first and second person allowed */
    const char *cast[4];
    int ncast;
} gen;

/* ---- randomness: xoshiro256** seeded by splitmix64 ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(gen *g) {
    uint64_t *s = g->s, r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

static uint32_t below(gen *g, uint32_t n) { return (uint32_t)(((next_u64(g) >> 32) * n) >> 32); }
static int chance(gen *g, uint32_t pct) { return below(g, 100) < pct; }
/* Skewed toward the front of a list: P(i) falls linearly with i. */
static uint32_t skew(gen *g, uint32_t n) {
    uint32_t a = below(g, n), b = below(g, n);
    return a < b ? a : b;
}

/* ---- output ---- */

static void put(gen *g, const char *s, size_t len) {
    size_t k = g->cap - g->n < len ? g->cap - g->n : len;
    memcpy(g->buf + g->n, s, k);
    g->n += k;
}

static char upper_ascii(char c) { return c >= 'a' && c <= 'z' ? (char)(c - 'a' + 'A') : c; }

/* A word, after a space or, past the wrap column, a newline. */
static void word(gen *g, const char *w) {
    size_t len = strlen(w) + (size_t)g->quote;
    if (g->space) {
        if (g->col + 1 + (int)len > g->wrap) {
            put(g, "\n", 1);
            g->col = 0;
        } else {
            put(g, " ", 1);
            g->col++;
        }
    }
    if (g->quote) put(g, "\"", 1);
    if (g->upper && w[0]) {
        char c = upper_ascii(w[0]);
        put(g, &c, 1);
        put(g, w + 1, strlen(w) - 1);
        g->upper = 0;
    } else {
        put(g, w, strlen(w));
    }
    g->quote = 0;
    g->col += (int)len;
    g->space = 1;
}

static void punct(gen *g, const char *p) {
    put(g, p, strlen(p));
    g->col += (int)strlen(p);
}

static void open_quote(gen *g) { g->quote = 1; }

static void end_line(gen *g) {
    put(g, "\n", 1);
    g->col = 0;
    g->space = 0;
}

static void word_caps(gen *g, const char *w) {
    char tmp[32];
    size_t i = 0;
    for (; w[i] && i + 1 < sizeof tmp; i++) tmp[i] = upper_ascii(w[i]);
    tmp[i] = '\0';
    word(g, tmp);
}

/* ---- grammar ---- */

static int starts_with_vowel_sound(const char *w) {
    return strchr("aeiou", w[0]) != NULL || !strncmp(w, "honest", 6) || !strncmp(w, "hour", 4);
}

static const char *name(gen *g) {
    if (g->play && g->ncast > 0 && chance(g, 70)) return g->cast[below(g, (uint32_t)g->ncast)];
    return k_names[skew(g, N(k_names))];
}

/* Determiner, optional adjectives and a noun from list, singular or plural (or either
 * when plural < 0); returns P3S or P3P. allow_a = 0 keeps to definite determiners. */
static int noun_phrase(gen *g, const noun *list, uint32_t nlist, int allow_a, int plural) {
    if (plural < 0) plural = chance(g, 28);
    const noun *nn = &list[skew(g, nlist)];
    const char *adj = chance(g, 38) ? k_adjs[skew(g, N(k_adjs))] : NULL;
    const char *adj2 = adj && chance(g, 12) ? k_adjs[skew(g, N(k_adjs))] : NULL;
    if (adj2 == adj) adj2 = NULL;
    const char *first = adj ? adj : plural ? nn->pl : nn->sg;
    static const char *const sg[] = {"the", "the", "the", "a", "a", "my", "your", "his",
                                     "her", "this", "that", "our", "their", "every"};
    static const char *const pl[] = {"the", "the", "the", "my", "your", "his", "her",
                                     "these", "those", "some", "our", "their", "all the",
                                     "two", "three", "many"};
    const char *det = plural ? pl[skew(g, N(pl))] : sg[skew(g, allow_a ? N(sg) : 3)];
    if (!strcmp(det, "a") && starts_with_vowel_sound(first)) det = "an";
    word(g, det);
    if (adj) word(g, adj);
    if (adj2) {
        punct(g, ",");
        word(g, adj2);
    }
    word(g, plural ? nn->pl : nn->sg);
    return plural ? P3P : P3S;
}

/* A place: "near the old gate" (motion = 0) or "into the forest" (motion = 1). */
static void prep_phrase(gen *g, int motion) {
    word(g, motion ? k_motion[skew(g, N(k_motion))] : k_at[skew(g, N(k_at))]);
    noun_phrase(g, k_places, N(k_places), 1, -1);
}

static void verb_phrase(gen *g, int person, int tense, int depth);

/* A noun phrase in subject (obj = 0) or object position; returns its person. */
static int np(gen *g, int obj, int depth) {
    uint32_t r = below(g, 100);
    if (g->play && r < 22) {
        static const char *const subj[] = {"I", "you", "we", "he", "she", "they"};
        static const char *const objs[] = {"me", "you", "us", "him", "her", "them"};
        static const int person[] = {P1S, P2, P1P, P3S, P3S, P3P};
        uint32_t i = skew(g, 6);
        word(g, obj ? objs[i] : subj[i]);
        return person[i];
    }
    if (r < 32) {
        static const char *const subj[] = {"he", "she", "they", "it"};
        static const char *const objs[] = {"him", "her", "them", "it"};
        static const int person[] = {P3S, P3S, P3P, P3S};
        uint32_t i = skew(g, 4);
        word(g, obj ? objs[i] : subj[i]);
        return person[i];
    }
    if (r < 50) {
        word(g, name(g));
        return P3S;
    }
    int person = chance(g, 60) ? noun_phrase(g, k_people, N(k_people), 1, -1)
                               : noun_phrase(g, k_things, N(k_things), 1, -1);
    if (depth > 0 && chance(g, 10)) {
        word(g, "of");
        noun_phrase(g, k_places, N(k_places), 0, -1);
    } else if (depth > 0 && chance(g, 7)) {
        word(g, "that");
        verb_phrase(g, person, chance(g, 50) ? PAST : PRES, depth - 1);
    }
    return person;
}

static const char *be(int person, int tense) {
    if (tense == BASE) return "be";
    if (tense == PRES) return person == P1S ? "am" : person == P3S ? "is" : "are";
    return person == P1S || person == P3S ? "was" : "were";
}

static const char *verb_form(const verb *v, int person, int tense) {
    if (tense == PAST) return v->past;
    if (tense == PRES && person == P3S) return v->s;
    return v->base;
}

static const verb *pick_verb(gen *g, int kind) {
    for (;;) {
        const verb *v = &k_verbs[skew(g, N(k_verbs))];
        if (v->kind & kind) return v;
    }
}

static void clause(gen *g, int tense, int depth) {
    verb_phrase(g, np(g, 0, depth), tense, depth);
}

/* A verb that does something (no copula, no auxiliary), with its object or its
 * adverb and place. */
static void action_phrase(gen *g, int person, int tense, int depth) {
    if (chance(g, 55)) {
        word(g, verb_form(pick_verb(g, VT), person, tense));
        np(g, 1, depth - 1);
        if (chance(g, 20)) prep_phrase(g, 0);
        return;
    }
    const verb *v = pick_verb(g, VI);
    word(g, verb_form(v, person, tense));
    if (chance(g, 30)) word(g, k_advs[skew(g, N(k_advs))]);
    if (chance(g, (v->kind & VM) ? 60 : 30)) prep_phrase(g, (v->kind & VM) != 0);
}

static void verb_phrase(gen *g, int person, int tense, int depth) {
    uint32_t r = below(g, 100);
    if (r < 18) {
        word(g, be(person, tense));
        if (chance(g, 50)) {
            if (chance(g, 25)) word(g, chance(g, 50) ? "very" : chance(g, 50) ? "not" : "so");
            word(g, k_adjs[skew(g, N(k_adjs))]);
        } else {
            prep_phrase(g, 0);
        }
        return;
    }
    if (r < 30 && tense != BASE) {
        word(g, k_modals[skew(g, N(k_modals))]);
        verb_phrase(g, person, BASE, depth);
        return;
    }
    if (r < 38 && tense != BASE) {
        const verb *v = pick_verb(g, VT | VI);
        word(g, be(person, tense));
        word(g, v->ing);
        if (v->kind & VT) np(g, 1, depth - 1);
        else if (chance(g, 50)) prep_phrase(g, (v->kind & VM) != 0);
        return;
    }
    if (r < 48 && depth > 0) {
        word(g, verb_form(pick_verb(g, VC), person, tense));
        if (chance(g, 60)) word(g, "that");
        clause(g, tense == BASE ? PRES : tense, depth - 1);
        return;
    }
    action_phrase(g, person, tense, depth);
}

/* A subject of the given person: a pronoun, a name or a noun phrase. */
static void subject_of(gen *g, int person) {
    static const char *const pron[] = {"I", "you", "he", "we", "they"};
    if (person == P3S) {
        uint32_t r = below(g, 3);
        if (r == 0) word(g, chance(g, 50) ? "he" : "she");
        else if (r == 1) word(g, name(g));
        else if (chance(g, 60)) noun_phrase(g, k_people, N(k_people), 1, 0);
        else noun_phrase(g, k_things, N(k_things), 1, 0);
    } else if (person == P3P && chance(g, 50)) {
        noun_phrase(g, k_people, N(k_people), 1, 1);
    } else {
        word(g, pron[person]);
    }
}

/* A question; returns its terminal punctuation. */
static const char *question(gen *g, int tense) {
    uint32_t r = below(g, 4);
    if (r == 0) {
        word(g, "who");
        verb_phrase(g, P3S, tense, 1);
        return "?";
    }
    if (r == 1) {
        word(g, k_modals[skew(g, 4)]);
        verb_phrase(g, np(g, 0, 1), BASE, 1);
        return "?";
    }
    if (chance(g, 50)) word(g, k_wh[below(g, N(k_wh))]);
    /* do-support: the auxiliary agrees with the subject, the verb stays in its base form */
    static const int persons[] = {P2, P3S, P1P, P3P, P1S};
    int person = persons[skew(g, N(persons))];
    word(g, tense == PAST ? "did" : person == P3S ? "does" : "do");
    subject_of(g, person);
    action_phrase(g, person, BASE, 1);
    return "?";
}

/* The body of one sentence (capitalised); returns its terminal punctuation. */
static const char *sentence(gen *g, int tense, int depth) {
    uint32_t r = below(g, 100);
    if (g->play) {
        if (r < 10) {
            word(g, k_interj[skew(g, N(k_interj))]);
            punct(g, ",");
            clause(g, tense, depth);
            return chance(g, 30) ? "!" : ".";
        }
        if (r < 22) return question(g, tense);
        if (r < 32) {
            verb_phrase(g, P2, BASE, depth);
            return chance(g, 40) ? "!" : ".";
        }
        if (r < 40) {
            word(g, chance(g, 50) ? k_address[skew(g, N(k_address))] : name(g));
            punct(g, ",");
            clause(g, tense, depth);
            return ".";
        }
    }
    if (r < 52) {
        word(g, k_subord[skew(g, N(k_subord))]);
        clause(g, tense, depth - 1);
        punct(g, ",");
        clause(g, tense, depth - 1);
        return ".";
    }
    if (r < 65) {
        clause(g, tense, depth - 1);
        punct(g, ",");
        word(g, k_conj[skew(g, N(k_conj))]);
        clause(g, tense, depth - 1);
        return ".";
    }
    if (r < 70 && !g->play) {
        int plural = chance(g, 28);
        word(g, "there");
        word(g, be(plural ? P3P : P3S, tense));
        noun_phrase(g, k_things, N(k_things), 1, plural);
        prep_phrase(g, 0);
        return ".";
    }
    clause(g, tense, depth);
    return ".";
}

/* Quoted speech inside prose: "Body," said Name. */
static void quoted(gen *g) {
    open_quote(g);
    g->play = 1;
    g->ncast = 0;
    g->upper = 1;
    const char *end = sentence(g, PRES, 2);
    g->play = 0;
    punct(g, !strcmp(end, ".") ? ",\"" : !strcmp(end, "?") ? "?\"" : "!\"");
    word(g, !strcmp(end, "?") ? "asked" : k_said[skew(g, N(k_said) - 1)]);
    if (chance(g, 70)) word(g, name(g));
    else noun_phrase(g, k_people, N(k_people), 0, -1);
    punct(g, ".");
}

static void paragraph(gen *g) {
    g->wrap = 72;
    g->play = 0;
    uint32_t k = 3 + below(g, 5);
    for (uint32_t i = 0; i < k && g->n < g->cap; i++) {
        g->upper = 1;
        if (chance(g, 18)) {
            quoted(g);
        } else {
            punct(g, sentence(g, chance(g, 85) ? PAST : PRES, 3));
        }
    }
    end_line(g);
    end_line(g);
}

static void scene(gen *g) {
    g->wrap = 60;
    g->ncast = 2 + (int)below(g, 3);
    for (int i = 0; i < g->ncast; i++) {
        const char *c;
        int dup;
        do {
            c = k_names[skew(g, N(k_names))];
            dup = 0;
            for (int j = 0; j < i; j++) dup |= g->cast[j] == c;
        } while (dup);
        g->cast[i] = c;
    }
    g->play = 0;
    if (chance(g, 40)) {
        word(g, "SCENE");
        word(g, k_roman[skew(g, N(k_roman))]);
        punct(g, ".");
        g->upper = 1;
        noun_phrase(g, k_places, N(k_places), 1, -1);
        if (chance(g, 50)) prep_phrase(g, 0);
        punct(g, ".");
        end_line(g);
        end_line(g);
    }
    word(g, "Enter");
    for (int i = 0; i < g->ncast; i++) {
        if (i > 0 && i < g->ncast - 1) punct(g, ",");
        if (i > 0 && i == g->ncast - 1) word(g, "and");
        word(g, g->cast[i]);
    }
    punct(g, ".");
    end_line(g);
    end_line(g);
    g->play = 1;
    int prev = -1;
    uint32_t speeches = 3 + below(g, 7);
    for (uint32_t s = 0; s < speeches && g->n < g->cap; s++) {
        int who = (int)below(g, (uint32_t)g->ncast);
        if (who == prev) who = (who + 1) % g->ncast;
        word_caps(g, g->cast[who]);
        punct(g, ":");
        end_line(g);
        uint32_t k = 1 + skew(g, 4);
        for (uint32_t i = 0; i < k; i++) {
            g->upper = 1;
            if (i == 0 && prev >= 0 && chance(g, 20)) {
                word(g, k_interj[skew(g, N(k_interj))]);
                punct(g, ",");
                g->upper = 0;
                word(g, g->cast[prev]);
                punct(g, ",");
                clause(g, PRES, 2);
                punct(g, chance(g, 30) ? "!" : ".");
                continue;
            }
            punct(g, sentence(g, chance(g, 75) ? PRES : PAST, 3));
        }
        end_line(g);
        end_line(g);
        prev = who;
    }
    g->play = 0;
    if (chance(g, 70)) {
        word(g, "Exeunt.");
    } else {
        word(g, "Exit");
        word(g, g->cast[below(g, (uint32_t)g->ncast)]);
        punct(g, ".");
    }
    end_line(g);
    end_line(g);
}

fy_status fy_corpus_generate(size_t nbytes, uint64_t seed, uint8_t **out) {
    *out = NULL;
    gen g = {0};
    g.buf = malloc(nbytes ? nbytes : 1);
    if (!g.buf) {
        fy_log_error("corpus: out of memory for %zu bytes", nbytes);
        return FY_ERR_NOMEM;
    }
    g.cap = nbytes;
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) g.s[i] = splitmix64(&x);
    while (g.n < g.cap) {
        if (chance(&g, 45)) {
            uint32_t k = 1 + below(&g, 3);
            for (uint32_t i = 0; i < k; i++) paragraph(&g);
        } else {
            scene(&g);
        }
    }
    *out = g.buf;
    return FY_OK;
}
