/*
 * kvoffload's CPU copy kernel: indexed block records to indexed block records, one pass.
 *
 * copy_records(src, src_record_stride, src_view_stride,
 *              dst, dst_record_stride, dst_view_stride,
 *              views, page_bytes, src_idx, dst_idx, n, streaming)
 *
 * For i in [0, n) and v in [0, views): copies page_bytes bytes from
 *   src + src_idx[i] * src_record_stride + v * src_view_stride
 * to
 *   dst + dst_idx[i] * dst_record_stride + v * dst_view_stride.
 * Addresses and strides are byte values; src_idx and dst_idx are addresses of int64
 * arrays of n entries. The caller (kvoffload.transfer.cpu_kernel) guarantees bounds
 * and that source and destination pages do not overlap. The GIL is released for the
 * whole copy, so several threads can copy parts of one job at once.
 *
 * streaming != 0 writes with non-temporal stores where the CPU has them (SSE2 on
 * x86-64): a page-sized memcpy otherwise reads each destination line before writing
 * it, about a third more memory traffic. Falls back to memcpy elsewhere, and for the
 * unaligned head and tail of a page.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define KVO_STREAMING 1
#else
#define KVO_STREAMING 0
#endif

static void copy_page(char *dst, const char *src, size_t n, int streaming) {
#if KVO_STREAMING
    if (streaming && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t blocks = n / 64;
        for (size_t b = 0; b < blocks; b++) {
            __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0));
            __m128i a1 = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i a3 = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)(dst + 0), a0);
            _mm_stream_si128((__m128i *)(dst + 16), a1);
            _mm_stream_si128((__m128i *)(dst + 32), a2);
            _mm_stream_si128((__m128i *)(dst + 48), a3);
            src += 64;
            dst += 64;
        }
        memcpy(dst, src, n - blocks * 64);
        return;
    }
#endif
    (void)streaming;
    memcpy(dst, src, n);
}

static PyObject *kvo_copy_records(PyObject *self, PyObject *args) {
    unsigned long long src, dst, src_idx, dst_idx;
    long long src_rs, src_vs, dst_rs, dst_vs, views, page, n;
    int streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLKLLLLKKLp", &src, &src_rs, &src_vs, &dst, &dst_rs, &dst_vs,
                          &views, &page, &src_idx, &dst_idx, &n, &streaming)) {
        return NULL;
    }
    const int64_t *si = (const int64_t *)(uintptr_t)src_idx;
    const int64_t *di = (const int64_t *)(uintptr_t)dst_idx;
    const char *s = (const char *)(uintptr_t)src;
    char *d = (char *)(uintptr_t)dst;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++) {
        const char *sr = s + si[i] * src_rs;
        char *dr = d + di[i] * dst_rs;
        for (long long v = 0; v < views; v++) {
            copy_page(dr + v * dst_vs, sr + v * src_vs, (size_t)page, streaming);
        }
    }
#if KVO_STREAMING
    if (streaming) {
        _mm_sfence();
    }
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_records", kvo_copy_records, METH_VARARGS,
     "Copy indexed block records to indexed block records (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copykernel", "kvoffload's CPU copy kernel.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copykernel(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", KVO_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
